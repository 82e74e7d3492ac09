"""A Hugging Face Hub on 127.0.0.1, answering what huggingface_hub 2.x asks (read from its source:
hf_api.model_info, file_download.get_hf_file_metadata / http_get) the way huggingface.co answers:

- ``GET /api/models/OWNER/NAME/revision/REV[?blobs=true]``: ``{"id", "sha", "siblings": [{"rfilename",
  "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}`` (sizes only with blobs=true).
- ``HEAD|GET /OWNER/NAME/resolve/REV/PATH``: a small file is served here with ``ETag`` (its git blob id)
  and ``X-Repo-Commit``; an LFS file (every .gguf) is a 302 to another origin (the CDN: huggingface_hub
  follows redirects only within the Hub, and takes the metadata from this response) with
  ``X-Linked-Etag`` (its sha256), ``X-Linked-Size`` and ``X-Repo-Commit``.
- the CDN: ``GET /blob/SHA256``, honouring ``Range: bytes=N-`` with 206 and Content-Range.
- errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), which is how
  huggingface_hub tells them apart.
Every request is recorded (method, origin, path, headers) so a test can say what was asked."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None          # a gated repo: requests need "Authorization: Bearer <token>"

    def is_lfs(self, path: str) -> bool:
        return path.endswith(".gguf")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Request:
    origin: str                        # "hub" | "cdn"
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    requests: list[Request] = field(default_factory=list)
    cut_after: int | None = None       # the CDN drops the next transfer after this many bytes (once)
    served_bytes: int = 0              # body bytes the CDN sent

    def __post_init__(self):
        self._blobs = {hashlib.sha256(d).hexdigest(): d for r in self.repos.values() for d in r.files.values()}
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, origin)) for origin in ("hub", "cdn")]
        for s in self._servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def close(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def asked(self, origin: str | None = None, method: str | None = None) -> list[Request]:
        return [r for r in self.requests if (origin is None or r.origin == origin) and (method is None or r.method == method)]


def _handler(hub: FakeHub, origin: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _reply(self, status: int, headers: dict, data: bytes = b"", body: bool = True):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and data:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool, commit: str | None = None):
            data = json.dumps({"error": code}).encode()
            headers = {"X-Error-Code": code, "Content-Type": "application/json"}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._reply(status, headers, data, body)

        def _serve(self, body: bool):
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.requests.append(Request(origin, self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            if origin == "cdn":
                return self._cdn(path, body)
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/"):], parse_qs(url.query), body)
            parts = path.strip("/").split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._error(404, "NotFound", body)

        def _repo(self, name: str, body: bool) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(401, "RepoNotFound", body)  # the Hub's answer for missing and private alike
                return None
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", body)
                return None
            return repo

        def _api(self, rest: str, query: dict, body: bool):
            name, _, rev = rest.partition("/revision/")
            repo = self._repo(name, body)
            if repo is None:
                return
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", body)
            blobs = query.get("blobs") == ["True"] or query.get("blobs") == ["true"]
            siblings = []
            for p, d in sorted(repo.files.items()):
                s = {"rfilename": p}
                if blobs:
                    s.update(size=len(d), blobId=git_blob_id(d))
                    if repo.is_lfs(p):
                        s["lfs"] = {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}
                siblings.append(s)
            data = json.dumps({"_id": "x", "id": name, "modelId": name, "sha": repo.commit, "private": False,
                               "siblings": siblings, "tags": ["gguf"]}).encode()
            self._reply(200, {"Content-Type": "application/json"}, data, body)

        def _resolve(self, name: str, rev: str, file: str, body: bool):
            repo = self._repo(name, body)
            if repo is None:
                return
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", body)
            data = repo.files.get(file)
            if data is None:
                return self._error(404, "EntryNotFound", body, repo.commit)
            common = {"X-Repo-Commit": repo.commit, "ETag": f'"{git_blob_id(data)}"'}
            if not repo.is_lfs(file):
                return self._reply(200, {**common, "Content-Type": "text/plain"}, data, body)
            sha = hashlib.sha256(data).hexdigest()
            self._reply(302, {**common, "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(data),
                              "Location": f"{hub.cdn_url}/blob/{sha}?signed=1"}, b"", body)

        def _cdn(self, path: str, body: bool):
            data = hub._blobs.get(path.rsplit("/", 1)[-1])
            if data is None:
                return self._error(404, "NotFound", body)
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[len("bytes="):-1])
            chunk = data[start:]
            headers = {"Content-Type": "application/octet-stream", "Content-Length": len(chunk), "Accept-Ranges": "bytes"}
            status = 200
            if start:
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if not body:
                return self._reply(status, headers, b"", False)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.end_headers()
            if hub.cut_after is not None and hub.cut_after < len(chunk):
                n, hub.cut_after = hub.cut_after, None
                self.wfile.write(chunk[:n])
                hub.served_bytes += n
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the connection drops mid-transfer
                return
            self.wfile.write(chunk)
            hub.served_bytes += len(chunk)

    return Handler
