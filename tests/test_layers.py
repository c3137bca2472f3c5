#!/usr/bin/env python3
"""No #include runs up the layers (docs/architecture.md, "The house by layer").

Each source folder is a layer and may include only from the layers below it
and from the installed headers it is allowed. The rules, lowest layer first:

  src/kernels      kernels/ and the type headers of include/qkv (no front end)
  src/core         core/ and include/qkv
  src/io           core/, io/ and include/qkv
  src/ops, src/attention, src/regression
                   core/, io/, kernels/, their own folder and include/qkv
  src/store        everything in src/ but nothing of extras/ or apps/ (and
                   only src/store includes the store's installed headers)
  extras/chapter   src/ and include/qkv (qkv::chapter)
  apps/search      search/ and include/qkv, none of the library's private headers

Run by CTest as `layers`; `--self-test` checks that a planted upward include
is reported (so the check can fail).
"""

import argparse
import os
import re
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*(?:include|define\s+HWY_TARGET_INCLUDE)\s+"([^"]+)"', re.M)

# Installed headers a kernel may include: types, no front end.
KERNEL_PUBLIC = {"qkv/bfloat16.h", "qkv/tensor.h", "qkv/valid_lens.h",
                 "qkv/kernel_regression_types.h", "qkv/threads.h"}

# folder -> the include prefixes its files may name ("qkv/" is the installed
# headers; a prefix ending in "/" is a folder of src/ or apps/).
ALLOWED = {
    "src/kernels": ["kernels/"] + sorted(KERNEL_PUBLIC),
    "src/core": ["core/", "qkv/"],
    "src/io": ["core/", "io/", "qkv/"],
    "src/ops": ["core/", "io/", "kernels/", "ops/", "qkv/"],
    "src/attention": ["core/", "io/", "kernels/", "attention/", "qkv/"],
    "src/regression": ["core/", "io/", "kernels/", "regression/", "qkv/"],
    "src/store": ["core/", "io/", "kernels/", "ops/", "attention/", "store/", "qkv/"],
    "extras/chapter": ["core/", "io/", "qkv/"],
    "apps/search": ["search/", "qkv/"],
}
# The installed headers the library itself must not include: the extras'.
LIBRARY_FORBIDDEN_PUBLIC = {"qkv/plot.h", "qkv/lookup.h", "qkv/chapter.h"}
# The store's installed headers, which only the store layer (and what sits
# above the library) may include: ops and attention know no store.
STORE_PUBLIC = {"qkv/store.h", "qkv/store_attention.h", "qkv/mpi.h"}


def layer_of(path):
    """The longest folder of ALLOWED that holds path, or None."""
    best = None
    for folder in ALLOWED:
        if path.startswith(folder + "/") and (best is None or len(folder) > len(best)):
            best = folder
    return best


def violations(root):
    """Every (file, line, included, layer) that breaks its layer's rule."""
    found = []
    for folder in sorted(ALLOWED):
        top = os.path.join(root, folder)
        for dirpath, _, names in os.walk(top):
            for name in sorted(names):
                if not name.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                layer = layer_of(rel)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for match in INCLUDE.finditer(text):
                    included = match.group(1)
                    line = text.count("\n", 0, match.start()) + 1
                    ok = any(included == p or (p.endswith("/") and included.startswith(p))
                             for p in ALLOWED[layer])
                    if rel.startswith("src/") and included in LIBRARY_FORBIDDEN_PUBLIC:
                        ok = False
                    if (rel.startswith("src/") and not rel.startswith("src/store/")
                            and included in STORE_PUBLIC):
                        ok = False
                    if not ok:
                        found.append((rel, line, included, layer))
    return found


def self_test():
    """A planted upward include in each kind of layer is reported; clean files are not."""
    planted = {
        "src/kernels/simd/a.cc": ('#include "core/check.h"\n', True),
        "src/kernels/runtime/b.h": ('#include "qkv/attention.h"\n', True),
        "src/kernels/attention/c.cc": ('#include "kernels/runtime/blas.h"\n'
                                       '#include "qkv/tensor.h"\n', False),
        "src/ops/d.cc": ('#include "store/store_parts.h"\n', True),
        "src/attention/d2.cc": ('#include "qkv/store.h"\n', True),
        "src/attention/e.cc": ('#include "kernels/kernels.h"\n#include "core/check.h"\n', False),
        "src/store/f.cc": ('#include "qkv/plot.h"\n', True),
        "src/core/g.cc": ('#define HWY_TARGET_INCLUDE "kernels/x.cc"\n', True),
        "apps/search/h.cc": ('#include "kernels/kernels.h"\n', True),
        "extras/chapter/i.cc": ('#include "core/check.h"\n#include "qkv/plot.h"\n', False),
    }
    with tempfile.TemporaryDirectory() as root:
        for rel, (text, _) in planted.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
                f.write(text)
        reported = {v[0] for v in violations(root)}
    expected = {rel for rel, (_, bad) in planted.items() if bad}
    if reported != expected:
        print(f"self-test failed: reported {sorted(reported)}, expected {sorted(expected)}")
        return 1
    print(f"self-test: {len(expected)} planted upward includes reported, "
          f"{len(planted) - len(expected)} clean files passed")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    found = violations(args.root)
    for rel, line, included, layer in found:
        print(f"{rel}:{line}: #include \"{included}\" runs up the layers "
              f"({layer} may include {', '.join(ALLOWED[layer])})")
    checked = sum(1 for folder in ALLOWED for _, _, names in os.walk(os.path.join(args.root, folder))
                  for n in names if n.endswith((".h", ".cc")))
    if checked == 0:
        print("no source files found under", args.root)
        return 1
    print(f"{checked} files checked, {len(found)} upward includes")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
