"""The controller's fetch-rows init container (run.data.source: url): download URL to DEST, check SHA256.

    python fetch_rows.py URL DEST [SHA256]

DEST ending in "/" is a folder: the file keeps the URL's last path part as its name (rows.jsonl when there is
none), as the chart names it (docker-compose.rows-url.yml uses this).

HF_TOKEN, when set, is sent to huggingface.co only (not along a redirect: the hub's file URLs redirect to
signed ones). The file is written next to DEST and renamed into place once whole and matching, so the
controller never reads a partial or wrong download; any failure exits non-zero and the pod retries.
"""

import hashlib
import os
import posixpath
import sys
import urllib.parse
import urllib.request

url, dest = sys.argv[1], sys.argv[2]
if dest.endswith("/"):
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    dest += posixpath.basename(path.rstrip("/")) or "rows.jsonl"
want = sys.argv[3].strip().lower() if len(sys.argv) > 3 else ""
request = urllib.request.Request(url)
host = urllib.parse.urlsplit(url).hostname or ""
token = os.environ.get("HF_TOKEN", "")
if token and (host == "huggingface.co" or host.endswith(".huggingface.co")):
    request.add_unredirected_header("Authorization", f"Bearer {token}")
digest, size, part = hashlib.sha256(), 0, dest + ".part"
with urllib.request.urlopen(request, timeout=60) as response, open(part, "wb") as out:
    while chunk := response.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
        size += len(chunk)
if want and digest.hexdigest() != want:
    os.remove(part)
    sys.exit(f"fetch-rows: {url}: sha256 {digest.hexdigest()}, expected {want}")
os.replace(part, dest)
print(f"fetch-rows: {url} -> {dest}: {size} bytes, sha256 {digest.hexdigest()}")
