#!/usr/bin/env python3
"""Every code block in README.md and docs/*.md runs as written, or says why not.

Each fenced block is extracted and, by its language:

  sh, bash, shell  run by bash (-e, pipefail) in the file's scratch folder;
  console          each `$ command` run there, its output checked against the
                   lines that follow it;
  python           run by Debian's /usr/bin/python3 with the built package on
                   PYTHONPATH (as after `cmake --install`);
  cpp              compiled against the installed package (find_package(qkv),
                   qkv::qkv; qkv::chapter, or qkv::mpi with COMPONENTS mpi,
                   when it includes their headers) and run there; a block
                   without `int main` is the body of one (its #include lines
                   above it);
  cmake            the body of a project's CMakeLists.txt after
                   `add_executable(my_app main.cc)` (main.cc includes
                   <qkv/qkv.h>), configured and built against the package;

or it is marked by an HTML comment right before it (blank lines between are
fine; GitHub shows none of them):

  <!-- not run: REASON -->   not runnable here, and why (a synopsis, a
                              machine-specific report, takes 14 min, ...);
  <!-- output -->            the output (stdout and stderr) of the last block
                              run before it, checked: lines match exactly
                              after trailing spaces, `...` alone on a line
                              stands for any lines, `...` inside a line for
                              any text;
  <!-- setup: COMMANDS -->   shell commands run (hidden) before the block,
                              e.g. to make its input files.

A block with neither a runnable language nor a marker fails the test, as does
a block that exits non-zero, prints other than its output block, or calls a
bare `python3` (on a machine whose first python3 is not Debian's, NumPy is
missing: the docs say /usr/bin/python3). The blocks of one file run in order
in one scratch folder, which stands in for a clone of the repository after
`scripts/build.sh demo`: scripts/, examples/, bench/, tests/ and the sources
are links to the real ones, build/release to the build tree under test, and
PATH is a fresh Debian 12's with `qkv` on it. Relative links must point at
files the repository ships. Each failure names the file, the block's line and
why, with the end of what it printed.

Usage: test_doc_examples.py --source DIR --build DIR [--only FILE ...] [--self-test]
"""

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RUN_LANGUAGES = {"sh", "bash", "shell", "console", "python", "cpp", "cmake"}
BLOCK_TIMEOUT_S = 120  # a block that needs longer is shrunk or marked "not run: takes N min"
MARKER = re.compile(r"^(not run|output|setup)\b:?\s*(.*)$", re.S)


@dataclasses.dataclass
class Block:
    path: str  # as the repository names it: README.md, docs/cli.md
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    markers: dict  # "not run" -> reason, "output" -> "", "setup" -> commands

    def where(self):
        return f"{self.path}:{self.line} ({'```' + self.lang if self.lang else 'a plain ``` block'})"


class DocError(Exception):
    pass


def parse(path, text):
    """The fenced blocks of one Markdown file, with the markers before each."""
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([^\s`]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*" + fence + r"\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise DocError(f"{path}:{i + 1}: the code block opened here is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:j]]
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", markers_before(lines, i, path)))
        i = j + 1
    return blocks


def markers_before(lines, fence, path):
    """The HTML comments right above line `fence` (0-based), blank lines between allowed."""
    markers = {}
    k = fence - 1
    while k >= 0:
        if not lines[k].strip():
            k -= 1
            continue
        if not lines[k].rstrip().endswith("-->"):
            break
        end = k
        while k >= 0 and "<!--" not in lines[k]:
            k -= 1
        if k < 0:
            break
        comment = "\n".join(lines[k:end + 1]).strip()
        inner = comment[comment.index("<!--") + 4:comment.rindex("-->")].strip()
        m = MARKER.match(inner)
        if m is None:
            # Another comment (a generator's note, say) ends the markers.
            break
        kind, value = m.group(1), m.group(2).strip()
        if kind == "not run" and len(value.split()) < 2:
            raise DocError(f"{path}:{k + 1}: `<!-- not run: ... -->` needs a reason of a few words, "
                           f"got {value!r}")
        if kind == "setup" and not value:
            raise DocError(f"{path}:{k + 1}: `<!-- setup: ... -->` holds no commands")
        markers[kind] = value
        k -= 1
    return markers


# ---- matching output ----------------------------------------------------------

def normalise(text):
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def line_matches(expected, got):
    if "..." not in expected:
        return expected == got
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, got) is not None


def output_matches(expected, got):
    """Lines of `expected` against lines of `got`; a line `...` matches any lines."""
    exp, out = normalise(expected), normalise(got)
    memo = {}

    def match(i, j):
        if (i, j) in memo:
            return memo[(i, j)]
        if i == len(exp):
            result = j == len(out)
        elif exp[i].strip() == "...":
            result = any(match(i + 1, jj) for jj in range(j, len(out) + 1))
        else:
            result = j < len(out) and line_matches(exp[i], out[j]) and match(i + 1, j + 1)
        memo[(i, j)] = result
        return result

    return match(0, 0)


def tail(text, lines=25):
    kept = text.rstrip("\n").split("\n")
    cut = kept[-lines:]
    prefix = f"    [... {len(kept) - lines} lines before]\n" if len(kept) > lines else ""
    return prefix + "\n".join("    | " + line for line in cut)


def output_difference(expected, got):
    return ("  the doc shows:\n" + tail(expected, 40) + "\n  it printed:\n" +
            (tail(got, 40) if got.strip() else "    (nothing)"))


# ---- the scratch folder: a clone after `scripts/build.sh demo` -----------------

class Sandbox:
    def __init__(self, root, source, build, qkv, scratch):
        self.root = root  # this file's scratch folder, the blocks' working directory
        self.source = source
        self.build = build
        os.makedirs(root)
        for name in sorted(os.listdir(source)):
            if name in ("build", ".git"):
                continue
            os.symlink(os.path.join(source, name), os.path.join(root, name))
        os.makedirs(os.path.join(root, "build"))
        os.symlink(build, os.path.join(root, "build", "release"))
        venv = os.path.join(source, "build", "venv")
        if os.path.exists(venv):
            os.symlink(venv, os.path.join(root, "build", "venv"))
        bin_dir = os.path.join(scratch, "bin")
        if not os.path.exists(bin_dir):
            os.makedirs(bin_dir, exist_ok=True)
            os.symlink(qkv, os.path.join(bin_dir, "qkv"))
        self.env = {
            "PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "TMPDIR": scratch,
            "QKV_SEARCH_MODEL": os.environ.get("QKV_SEARCH_MODEL", ""),
        }
        self.python_env = dict(self.env, PYTHONPATH=os.path.join(build, "python"))

    def run(self, argv, env=None, stdin=None, timeout=BLOCK_TIMEOUT_S):
        """(status or None on timeout, stdout and stderr merged, seconds); a block that
        times out is killed with everything it started (its own process group)."""
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.root, env=env or self.env, text=True,
                                errors="replace", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(stdin or "", timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            status = None
        return status, out, time.monotonic() - start


BARE_PYTHON = re.compile(r"(^|[\s;|&(`$])(python3?)(?=[\s'\"]|$)", re.M)


def bare_python(script):
    """Lines calling python3 by PATH instead of Debian's /usr/bin/python3."""
    found = []
    for number, line in enumerate(script.split("\n"), 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("import") else ""
        if BARE_PYTHON.search(code):
            found.append(f"line {number}: {line.strip()}")
    return found


# ---- C++: one consumer project for every cpp and cmake block -----------------------

def cpp_source(block):
    if re.search(r"\bint\s+main\s*\(", block.text):
        return block.text
    includes = [line for line in block.text.split("\n") if line.startswith("#include")]
    body = [line for line in block.text.split("\n") if not line.startswith("#include")]
    return ("\n".join(["#include <qkv/qkv.h>", "#include <exception>", "#include <iostream>"] +
                      includes) +
            "\n\nint main() try {\n" + "\n".join("  " + line for line in body) +
            "\n  return 0;\n} catch (const std::exception& e) {\n"
            "  std::cerr << \"error: \" << e.what() << \"\\n\";\n  return 1;\n}\n")


def cpp_targets(block):
    targets = ["qkv::qkv"]
    if re.search(r"<qkv/(chapter|plot|lookup)\.h>", block.text):
        targets.append("qkv::chapter")
    if "<qkv/mpi.h>" in block.text:
        targets.append("qkv::mpi")
    return targets


def target_name(block):
    return re.sub(r"[^A-Za-z0-9]", "_", block.path) + f"_L{block.line}"


class CppBuild:
    """Installs the build into a prefix, then builds each block as its own target."""

    def __init__(self, blocks, build, scratch):
        self.results = {}  # target name -> (ok, message, executable)
        if not blocks:
            return
        prefix = os.path.join(scratch, "prefix")
        project = os.path.join(scratch, "cpp")
        out = os.path.join(scratch, "cpp-build")
        os.makedirs(project)
        proc = subprocess.run(["cmake", "--install", build, "--prefix", prefix],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            for block in blocks:
                self.results[target_name(block)] = (False, "cmake --install of the build failed:\n" +
                                                    tail(proc.stdout + proc.stderr), None)
            return
        top = ["cmake_minimum_required(VERSION 3.25)", "project(doc_examples CXX)",
               "set(CMAKE_CXX_STANDARD 20)", "set(CMAKE_CXX_STANDARD_REQUIRED ON)"]
        for block in blocks:
            name = target_name(block)
            folder = os.path.join(project, name)
            os.makedirs(folder)
            if block.lang == "cmake":
                with open(os.path.join(folder, "main.cc"), "w") as f:
                    f.write("#include <qkv/qkv.h>\nint main() { return 0; }\n")
                cmake = ("add_executable(my_app main.cc)\n" + block.text)
                cmake = cmake.replace("my_app", name)
            else:
                with open(os.path.join(folder, "main.cc"), "w") as f:
                    f.write(cpp_source(block))
                targets = cpp_targets(block)
                components = " COMPONENTS mpi" if "qkv::mpi" in targets else ""
                cmake = (f"find_package(qkv REQUIRED{components})\nadd_executable({name} main.cc)\n"
                         f"target_link_libraries({name} PRIVATE {' '.join(targets)})\n")
            with open(os.path.join(folder, "CMakeLists.txt"), "w") as f:
                f.write(cmake)
            top.append(f"add_subdirectory({name})")
        with open(os.path.join(project, "CMakeLists.txt"), "w") as f:
            f.write("\n".join(top) + "\n")
        proc = subprocess.run(["cmake", "-S", project, "-B", out, f"-DCMAKE_PREFIX_PATH={prefix}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            for block in blocks:
                self.results[target_name(block)] = (
                    False, "the consumer project did not configure (find_package(qkv) or a cmake "
                    "block):\n" + tail(proc.stdout + proc.stderr), None)
            return
        for block in blocks:
            name = target_name(block)
            proc = subprocess.run(["cmake", "--build", out, "--target", name, "-j", "2"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                self.results[name] = (False, "does not compile or link:\n" +
                                      tail(proc.stdout + proc.stderr, 40), None)
            else:
                self.results[name] = (True, "", os.path.join(out, name, name))


# ---- running one file's blocks ------------------------------------------------------

@dataclasses.dataclass
class FileResult:
    path: str
    run: int = 0
    marked: int = 0
    checked_outputs: int = 0
    failures: list = dataclasses.field(default_factory=list)
    slow: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def run_file(path, blocks, sandbox, cpp):
    result = FileResult(path)
    start = time.monotonic()
    last_output = None  # (block, what it printed) of the last block run
    for block in blocks:
        def fail(why, block=block):
            result.failures.append(f"{block.where()}: {why}")

        if "not run" in block.markers:
            result.marked += 1
            continue
        if "setup" in block.markers:
            status, out, _ = sandbox.run(["bash", "-e", "-o", "pipefail", "-c",
                                          block.markers["setup"]])
            if status != 0:
                fail(f"its <!-- setup: --> commands failed (status {status}):\n" + tail(out))
                continue
        if "output" in block.markers:
            if last_output is None:
                fail("marked <!-- output --> but no block ran before it in this file")
            elif not output_matches(block.text, last_output[1]):
                fail(f"is the output of {last_output[0].where()}, which printed something else:\n" +
                     output_difference(block.text, last_output[1]))
            else:
                result.checked_outputs += 1
            result.marked += 1
            last_output = None
            continue
        if block.lang not in RUN_LANGUAGES:
            fail("is neither run nor marked: the test runs sh, console, python, cpp and cmake "
                 "blocks; put `<!-- output -->` (it shows the output of the block before) or "
                 "`<!-- not run: REASON -->` on the line before it")
            continue
        if block.lang in ("sh", "bash", "shell", "console"):
            found = bare_python(block.text)
            if found:
                fail("calls python3 by PATH; say /usr/bin/python3 (Debian's, the one with NumPy):"
                     "\n    " + "\n    ".join(found))
                continue
        result.run += 1
        if block.lang == "console":
            ok, out, seconds = run_console(block, sandbox)
            if not ok:
                fail(out)
            last_output = None
        else:
            if block.lang == "python":
                status, out, seconds = sandbox.run(["/usr/bin/python3", "-"], env=sandbox.python_env,
                                                   stdin=block.text)
            elif block.lang in ("cpp", "cmake"):
                ok, message, exe = cpp.results[target_name(block)]
                seconds = 0.0
                if not ok:
                    fail(message)
                    continue
                if block.lang == "cmake":
                    last_output = (block, "")
                    continue
                status, out, seconds = sandbox.run([exe])
            else:
                status, out, seconds = sandbox.run(["bash", "-e", "-o", "pipefail", "-c", block.text])
            if status is None:
                fail(f"still running after {BLOCK_TIMEOUT_S} s: shrink it, or mark it "
                     f"`<!-- not run: takes N min -->`; it printed:\n" + tail(out))
            elif status != 0:
                fail(f"exited with status {status}; it printed:\n" + tail(out))
            last_output = (block, out)
        if seconds > 10:
            result.slow.append(f"{block.path}:{block.line} {seconds:.0f} s")
    result.seconds = time.monotonic() - start
    return result


def run_console(block, sandbox):
    """Runs each `$ command` of a console block in one shell; checks each one's output."""
    commands = []  # (command, expected output)
    lines = block.text.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            if not commands:
                return False, f"line {i + 1} of the block is not a `$ command`", ""
            commands[-1][1].append(lines[i])
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command + "\n" + lines[i]
        commands.append((command, []))
        i += 1
    separator = "@@qkv-doc-test-command-end@@"
    script = []
    for command, _ in commands:
        # Each command's output, then a separator; `$?` stays the command's own.
        script.append(f"{command}\n__status=$?; printf '\\n%s\\n' '{separator}'; (exit $__status)")
    status, out, seconds = sandbox.run(["bash", "-c", "\n".join(script)])
    if status is None:
        return False, f"still running after {BLOCK_TIMEOUT_S} s:\n" + tail(out), seconds
    parts = out.split(separator + "\n")
    problems = []
    for n, (command, expected) in enumerate(commands):
        got = parts[n] if n < len(parts) else ""
        if not output_matches("\n".join(expected), got):
            problems.append(f"`$ {command}` printed other than the block shows:\n" +
                            output_difference("\n".join(expected), got))
    return not problems, "\n".join(problems), seconds


# ---- links ----------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(path, text, source):
    found = []
    in_block = False
    for number, line in enumerate(text.split("\n"), 1):
        if re.match(r"^\s*```", line):
            in_block = not in_block
        if in_block:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            resolved = os.path.normpath(os.path.join(source, os.path.dirname(path), file))
            if not os.path.exists(resolved):
                found.append(f"{path}:{number}: links to {target}, which the repository does not ship")
    return found


# ---- the whole run ----------------------------------------------------------------------

def doc_files(source):
    files = ["README.md"] + sorted("docs/" + name for name in os.listdir(os.path.join(source, "docs"))
                                   if name.endswith(".md"))
    return [f for f in files if os.path.exists(os.path.join(source, f))]


def run_all(source, build, qkv, only=None, jobs=2, scratch=None):
    """Runs every file's blocks; returns (results, problems that are no block's)."""
    files = only or doc_files(source)
    parsed, problems = {}, []
    for path in files:
        with open(os.path.join(source, path), encoding="utf-8") as f:
            text = f.read()
        try:
            parsed[path] = parse(path, text)
        except DocError as e:
            problems.append(str(e))
        problems.extend(broken_links(path, text, source))
    own_scratch = scratch is None
    scratch = scratch or tempfile.mkdtemp(prefix="qkv-doc-examples-")
    try:
        cpp_blocks = [b for blocks in parsed.values() for b in blocks
                      if b.lang in ("cpp", "cmake") and "not run" not in b.markers
                      and "output" not in b.markers]
        cpp = CppBuild(cpp_blocks, build, scratch)
        sandboxes = {path: Sandbox(os.path.join(scratch, "files", path.replace("/", "_")),
                                   source, build, qkv, scratch) for path in parsed}
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_file, path, parsed[path], sandboxes[path], cpp)
                       for path in parsed]
            results = [f.result() for f in futures]
    finally:
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return results, problems


def report(results, problems, seconds):
    failures = problems + [f for r in results for f in r.failures]
    print(f"{'file':34} {'run':>4} {'marked':>7} {'outputs checked':>16} {'seconds':>8}")
    for r in results:
        print(f"{r.path:34} {r.run:4} {r.marked:7} {r.checked_outputs:16} {r.seconds:8.1f}")
    total_run = sum(r.run for r in results)
    total_marked = sum(r.marked for r in results)
    print(f"{'total':34} {total_run:4} {total_marked:7} "
          f"{sum(r.checked_outputs for r in results):16} {seconds:8.1f}")
    slow = [s for r in results for s in r.slow]
    if slow:
        print("blocks over 10 s: " + ", ".join(slow))
    if failures:
        print(f"\n{len(failures)} documented example(s) fail as written:\n", file=sys.stderr)
        for failure in failures:
            print("FAIL " + failure + "\n", file=sys.stderr)
    return not failures


# ---- self-test: the harness fails where it should ------------------------------------------

SELF_TEST_DOC = """# a page

<!-- not run: a synopsis, alternatives in brackets -->
```
qkv softmax --scores X.npy [--valid-lens L.npy]
```

```sh
echo one
/usr/bin/python3 -c 'print(2)'
```

<!-- output -->
```
one
2
```

```console
$ echo "a b c"
a ... c
$ false
$ echo $?
1
```

```python
print("x" * 3)
```

<!-- output -->
```
...
xxx
```
"""

SELF_TEST_BAD = [
    ("a plain block without a marker", "```\nqkv --help\n```\n", "is neither run nor marked"),
    ("a json block without a marker", "```json\n{}\n```\n", "is neither run nor marked"),
    ("a failing shell block", "```sh\nexit 3\n```\n", "exited with status 3"),
    ("a bare python3", "```sh\npython3 -c 'print(1)'\n```\n", "calls python3 by PATH"),
    ("a wrong output", "```sh\necho 1\n```\n<!-- output -->\n```\n2\n```\n",
     "which printed something else"),
    ("a console block's wrong output", "```console\n$ echo 1\n2\n```\n", "printed other than"),
    ("an output block first", "<!-- output -->\n```\n2\n```\n", "no block ran before it"),
    ("a failing python block", "```python\nraise SystemExit(4)\n```\n", "exited with status 4"),
    ("a setup that fails", "<!-- setup: false -->\n```sh\ntrue\n```\n", "setup: --> commands failed"),
    ("a C++ block that does not compile", "```cpp\nint x = qkv::no_such_function();\n```\n",
     "does not compile"),
    ("a broken link", "see [x](no-such-file.md)\n", "which the repository does not ship"),
    ("a reasonless not run", "<!-- not run: -->\n```\nx\n```\n", "needs a reason"),
]


def self_test(source, build, qkv):
    """The harness on pages written here: the good one passes, each bad one fails with its reason."""
    failed = []
    with tempfile.TemporaryDirectory(prefix="qkv-doc-self-test-") as fake:
        for name in os.listdir(source):
            if name not in ("README.md", "docs", "build", ".git"):
                os.symlink(os.path.join(source, name), os.path.join(fake, name))
        os.makedirs(os.path.join(fake, "docs"))
        with open(os.path.join(fake, "README.md"), "w") as f:
            f.write(SELF_TEST_DOC + "\n<!-- setup: echo made > input.txt -->\n```sh\ncat input.txt\n```\n"
                    "<!-- output -->\n```\nmade\n```\n"
                    "```cpp\n#include <qkv/qkv.h>\nstd::cout << qkv::kVersion << \"\\n\";\n```\n")
        for n, (name, text, _) in enumerate(SELF_TEST_BAD):
            with open(os.path.join(fake, "docs", f"bad{n:02d}.md"), "w") as f:
                f.write(f"# {name}\n\n{text}")
        results, problems = run_all(fake, build, qkv)
        by_file = {r.path: r for r in results}
        good = by_file.get("README.md")
        if good is None or good.failures or problems and any(p.startswith("README") for p in problems):
            failed.append("the good page failed: " + "\n".join((good.failures if good else []) + problems))
        elif (good.run, good.checked_outputs) != (5, 3):
            failed.append(f"the good page ran {good.run} blocks and checked {good.checked_outputs} "
                          f"outputs; expected 5 and 3")
        for n, (name, _, expected) in enumerate(SELF_TEST_BAD):
            path = f"docs/bad{n:02d}.md"
            messages = problems + (by_file[path].failures if path in by_file else [])
            messages = [m for m in messages if m.startswith(path)]
            if not any(expected in m for m in messages):
                failed.append(f"{name}: expected a failure saying {expected!r}, got {messages}")
    for f in failed:
        print("SELF-TEST FAIL " + f, file=sys.stderr)
    print(f"self-test: the good page passed and {len(SELF_TEST_BAD) - len(failed)} of "
          f"{len(SELF_TEST_BAD)} bad pages failed with their reason")
    return not failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="the repository (README.md, docs/)")
    parser.add_argument("--build", required=True, help="the build tree (qkv, python/, install)")
    parser.add_argument("--qkv", help="the qkv command (default: BUILD/qkv)")
    parser.add_argument("--only", nargs="*", help="files to test, e.g. docs/cli.md (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="files run side by side")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    source, build = os.path.abspath(args.source), os.path.abspath(args.build)
    qkv = os.path.abspath(args.qkv or os.path.join(build, "qkv"))
    if args.self_test:
        return 0 if self_test(source, build, qkv) else 1
    start = time.monotonic()
    results, problems = run_all(source, build, qkv, args.only, args.jobs)
    return 0 if report(results, problems, time.monotonic() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
