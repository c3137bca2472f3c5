#!/usr/bin/env python3
"""`qkv demo`'s index.html in headless Chromium: the page loads over HTTP and
every figure in it decodes (its inline script writes "all N images loaded"
into #image-check once the window has loaded).

Usage: test_demo_page.py --qkv PATH [--screenshot PNG]
Debian's chromium is required: if it is missing this test fails, never skips.
"""
import argparse
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

NUM_FIGURES = 13  # test_cli.py's DEMO_FIGURES


def chromium(url, profile, *extra):
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(exe, os.X_OK):
        sys.exit("test_demo_page.py: chromium not found: install Debian package chromium "
                 "(scripts/install-deps.sh test)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--virtual-time-budget=5000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--qkv", required=True)
    parser.add_argument("--screenshot", help="also save a screenshot of the page here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qkv-demo-page-") as tmp:
        out = os.path.join(tmp, "site")
        demo = subprocess.run([args.qkv, "demo", "--out", out], capture_output=True, text=True,
                              timeout=120)
        if demo.returncode != 0:
            sys.exit(f"qkv demo failed ({demo.returncode}): {demo.stderr}")
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=out)
        handler.log_message = lambda *a: None
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
            r = chromium(url, os.path.join(tmp, "profile"), "--dump-dom")
            if r.returncode != 0:
                sys.exit(f"chromium failed ({r.returncode}): {r.stderr}")
            match = re.search(r'<p id="image-check">([^<]*)</p>', r.stdout)
            if not match:
                sys.exit(f"no #image-check in the page chromium rendered:\n{r.stdout[:2000]}")
            expected = f"all {NUM_FIGURES} images loaded"
            if match.group(1) != expected:
                sys.exit(f"#image-check says {match.group(1)!r}, expected {expected!r}")
            # Section 4's figure (11.3 over random keys) is among them.
            if '<img src="random-keys-attention.png"' not in r.stdout:
                sys.exit("the page has no random-keys-attention.png (the 11.3 random-keys section)")
            print(f"{url}: {expected}")
            if args.screenshot:
                shot = os.path.abspath(args.screenshot)
                r = chromium(url, os.path.join(tmp, "profile"), f"--screenshot={shot}",
                             "--window-size=1400,3000")
                if r.returncode != 0 or not os.path.isfile(shot):
                    sys.exit(f"chromium screenshot failed ({r.returncode}): {r.stderr}")
                print(f"screenshot: {shot}")
        finally:
            server.shutdown()


if __name__ == "__main__":
    main()
