#!/usr/bin/env python3
"""`qkv demo`'s index.html, a walkthrough of d2l 11.1-11.3, in headless Chromium
at a desktop width (1280 px) and a phone width (390 px): the page has its
section headings in order, every figure on it decodes (naturalWidth > 0) and
fits inside the window, nothing overflows horizontally
(document.scrollingElement.scrollWidth <= innerWidth), and each step's figures
sit to the right of its numbers on a desktop and below them on a phone. The two
byte-identical figures (additive and dot-product attention over equal keys)
are shown once, with the reason. The checks are then run on a page broken on
purpose (a missing image, a fixed-width block) to show they can fail.

The page is measured inside an iframe of the exact width: headless Chromium
will not make its window narrower than 500 px.

Usage: test_demo_page.py --qkv PATH [--screenshot PREFIX]
Debian's chromium is required: if it is missing this test fails, never skips.
"""
import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

# test_cli.py's DEMO_FIGURES: the files `qkv demo` draws.
FIGURES = ["identity.png", "average-pooling.png", "average-pooling-attention.png",
           "nonparametric.png", "nonparametric-attention.png", "parametric-loss.png",
           "parametric.png", "parametric-attention.png", "cross-validated.png",
           "cross-validated-attention.png", "additive-attention.png",
           "dot-product-attention.png", "random-keys-attention.png"]
REPEATED = ("dot-product-attention.png", "additive-attention.png")  # (repeat, first)
SHOWN = [f for f in FIGURES if f != REPEATED[0]]
HEADINGS = ["H1 qkv demo: d2l 11.1-11.3", "H2 11.1 Queries, Keys, and Values",
            "H2 11.2 Attention Pooling by Similarity", "H2 11.3 Attention Scoring Functions"]
WIDTHS = {"desktop": 1280, "phone": 390}

# Measures the page in the iframe once it has loaded (its images included)
# and writes what it saw as JSON into #result.
WRAPPER = """<!DOCTYPE html>
<html><body style="margin: 0">
<iframe id="page" src="{page}" style="width: {width}px; height: {height}px; border: 0"></iframe>
<script>
document.getElementById('page').addEventListener('load', function () {{
  var w = this.contentWindow, d = w.document;
  function box(e) {{ var r = e.getBoundingClientRect();
    return {{left: r.left, right: r.right, top: r.top, bottom: r.bottom}}; }}
  var result = {{
    innerWidth: w.innerWidth,
    scrollWidth: d.scrollingElement.scrollWidth,
    headings: Array.from(d.querySelectorAll('h1, h2, h3')).map(function (h) {{
      return h.tagName + ' ' + h.textContent; }}),
    images: Array.from(d.images).map(function (i) {{
      var step = i.closest('.step'), pre = step && step.querySelector(':scope > pre');
      var caption = i.closest('figure') && i.closest('figure').querySelector('figcaption');
      return {{src: i.getAttribute('src'), complete: i.complete, naturalWidth: i.naturalWidth,
               box: box(i), numbers: pre ? box(pre) : null,
               numbersText: pre ? pre.textContent : '',
               caption: caption ? caption.textContent : ''}}; }}),
  }};
  var out = document.createElement('pre');
  out.id = 'result';
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
}});
</script>
</body></html>
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def chromium(url, profile, *extra):
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(exe, os.X_OK):
        sys.exit("test_demo_page.py: chromium not found: install Debian package chromium "
                 "(scripts/install-deps.sh test)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--hide-scrollbars", "--virtual-time-budget=5000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def measure(site, base_url, page, width, profile, screenshot=None):
    """What the page looks like in an iframe `width` px wide: WRAPPER's JSON."""
    name = f"measure-{width}-{page}"
    height = 8000 if screenshot else 900
    with open(os.path.join(site, name), "w", encoding="utf-8") as f:
        f.write(WRAPPER.format(page=page, width=width, height=height))
    extra = ["--window-size=1400,900", "--dump-dom"]
    if screenshot:
        extra = [f"--window-size={max(width, 500)},{height}", f"--screenshot={screenshot}"]
    r = chromium(f"{base_url}/{name}", profile, *extra)
    if r.returncode != 0:
        sys.exit(f"chromium failed ({r.returncode}) on {page} at {width} px: {r.stderr}")
    if screenshot:
        return None
    match = re.search(r'<pre id="result">([^<]*)</pre>', r.stdout)
    if not match:
        sys.exit(f"no #result after loading {page} at {width} px:\n{r.stdout[:2000]}")
    return json.loads(html.unescape(match.group(1)))


def problems(seen, width, expect_beside):
    """Every way the measured page falls short at this width, as sentences."""
    found = []
    if seen["innerWidth"] != width:
        found.append(f"the page was measured {seen['innerWidth']} px wide, not {width}")
    if seen["scrollWidth"] > seen["innerWidth"]:
        found.append(f"horizontal overflow: scrollWidth {seen['scrollWidth']} > innerWidth "
                     f"{seen['innerWidth']}")
    if seen["headings"] != HEADINGS:
        found.append(f"headings {seen['headings']}, expected {HEADINGS}")
    srcs = [i["src"] for i in seen["images"]]
    if srcs != SHOWN:
        found.append(f"images {srcs}, expected {SHOWN}")
    for i in seen["images"]:
        if not (i["complete"] and i["naturalWidth"] > 0):
            found.append(f"{i['src']} did not load (naturalWidth {i['naturalWidth']})")
        if i["box"]["left"] < 0 or i["box"]["right"] > seen["innerWidth"] + 0.5:
            found.append(f"{i['src']} is cut off: it spans {i['box']['left']:.0f} to "
                         f"{i['box']['right']:.0f} px of {seen['innerWidth']}")
        if len(i["caption"].split(". ", 1)[-1]) < 40:
            found.append(f"{i['src']} has no sentence on what to see: {i['caption']!r}")
        numbers, box = i["numbers"], i["box"]
        if numbers is None or not i["numbersText"].strip():
            found.append(f"{i['src']} is not in a step with its numbers")
        elif expect_beside and box["left"] < numbers["right"]:
            found.append(f"{i['src']} is not beside its numbers at {width} px: image {box}, "
                         f"numbers {numbers}")
        elif not expect_beside and box["top"] < numbers["bottom"]:
            found.append(f"{i['src']} is not below its numbers at {width} px: image {box}, "
                         f"numbers {numbers}")
    return found


def check_files(site):
    """The page's source: no debug line, the viewport for phones, the repeat said once."""
    with open(os.path.join(site, "index.html"), encoding="utf-8") as f:
        page = f.read()
    found = []
    if "images loaded" in page or "image-check" in page:
        found.append("the page still has the image-check debug line")
    if '<meta name="viewport" content="width=device-width, initial-scale=1">' not in page:
        found.append("no viewport meta: a phone would lay the page out 980 px wide")
    repeat, first = REPEATED
    with open(os.path.join(site, repeat), "rb") as a, open(os.path.join(site, first), "rb") as b:
        if a.read() != b.read():
            found.append(f"{repeat} and {first} are no longer byte-identical: show both")
    if f'<img src="{repeat}"' in page:
        found.append(f"{repeat} is shown although it is {first} byte for byte")
    reason = f"{repeat} is byte for byte {first}, shown above"
    if reason not in page or "the same uniform weights" not in page:
        found.append(f"the page does not say that {repeat} is {first}, and why")
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--qkv", required=True)
    parser.add_argument("--screenshot", help="also save screenshots at PREFIX-desktop.png and "
                        "PREFIX-phone.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qkv-demo-page-") as tmp:
        site = os.path.join(tmp, "site")
        demo = subprocess.run([args.qkv, "demo", "--out", site], capture_output=True, text=True,
                              timeout=120)
        if demo.returncode != 0:
            sys.exit(f"qkv demo failed ({demo.returncode}): {demo.stderr}")
        failures = check_files(site)

        # A copy broken on purpose: one image missing, one block wider than a phone.
        with open(os.path.join(site, "index.html"), encoding="utf-8") as f:
            page = f.read()
        with open(os.path.join(site, "broken.html"), "w", encoding="utf-8") as f:
            f.write(page.replace('src="identity.png"', 'src="missing.png"')
                    .replace("</h1>", '</h1>\n<div style="width: 600px">wide</div>'))

        handler = functools.partial(QuietHandler, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        profile = os.path.join(tmp, "profile")
        try:
            for label, width in WIDTHS.items():
                seen = measure(site, base_url, "index.html", width, profile)
                found = problems(seen, width, expect_beside=(label == "desktop"))
                failures += [f"{label} ({width} px): {p}" for p in found]
                if not found:
                    print(f"{label} ({width} px): {len(seen['images'])} figures loaded and "
                          f"inside the page, headings in order, scrollWidth "
                          f"{seen['scrollWidth']} <= {seen['innerWidth']}")
            # The checks can fail: the broken copy must fail both of these.
            seen = measure(site, base_url, "broken.html", WIDTHS["phone"], profile)
            found = problems(seen, WIDTHS["phone"], expect_beside=False)
            for needed in ("missing.png did not load", "horizontal overflow"):
                if not any(needed in p for p in found):
                    failures.append(f"the broken page was not caught ({needed!r}): {found}")
            if args.screenshot:
                for label, width in WIDTHS.items():
                    shot = os.path.abspath(f"{args.screenshot}-{label}.png")
                    measure(site, base_url, "index.html", width, profile, screenshot=shot)
                    print(f"screenshot: {shot}")
        finally:
            server.shutdown()
        if failures:
            sys.exit("test_demo_page.py: the demo page falls short:\n  " + "\n  ".join(failures))
        print("the demo page passes at " +
              " and ".join(f"{w} px" for w in WIDTHS.values()))


if __name__ == "__main__":
    main()
