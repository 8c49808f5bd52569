"""A fake Hugging Face Hub on 127.0.0.1 that records every request: just the endpoints huggingface_hub 2.4.0 uses
for ``create_repo``, ``create_branch`` and ``upload_folder``.

Endpoints (read from hf_api.py, _commit_api.py and lfs.py):

- ``POST /api/repos/create``: JSON {name, organization, type, visibility?}; 409 (with the url) if the repo exists.
- ``POST /api/models/{repo}/branch/{branch}``: creates a branch from main; 409 if it exists.
- ``POST /api/validate-yaml``: upload_folder validates README.md's front matter server-side before hashing.
- ``POST /api/models/{repo}/preupload/{rev}``: the server picks each file's upload mode ("regular": base64 inside
  the commit; "lfs": uploaded separately). Like the Hub: LFS for weight suffixes, 10 MiB and over, or binary samples.
- ``POST /{repo}.git/info/lfs/objects/batch``: git-LFS batch API, answered with "basic" transfer actions.
- ``PUT /lfs-upload/{oid}``: the object's bytes (checked against the sha256 oid), then ``POST /lfs-verify``.
- ``POST /api/models/{repo}/commit/{rev}``: ndjson (header, file, lfsFile lines), applied to the revision.

Anything else is answered 404 and recorded, so a test can assert that nothing unexpected was called. Every response
closes its connection (HTTP/1.0 style), so no handler thread outlives ``close()``.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".npz", ".png", ".jpg")
LFS_MIN_SIZE = 10 * 1024 * 1024
_REPO_OP = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<op>preupload|commit|branch)/(?P<rev>[^/?]+)$")
_LFS_BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")


@dataclass
class Request:
    method: str
    path: str  # without the query string
    query: dict
    headers: dict  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    files: dict = field(default_factory=dict)  # path -> bytes, sent inline (base64)
    lfs_files: dict = field(default_factory=dict)  # path -> (sha256 hex, size)
    pull_request: int | None = None  # the discussion number when the commit opened a pull request (create_pr=1)


class FakeHub:
    """``with FakeHub() as hub: ... hub.endpoint ... hub.requests``. ``lfs=False`` answers "regular" for every
    file; ``token``: the only token the API accepts (401 otherwise, like the Hub for a bad token)."""

    def __init__(self, lfs: bool = True, token: str | None = None):
        self.lfs = lfs
        self.token = token
        self.requests: list[Request] = []
        self.repos: dict[str, dict] = {}  # repo_id -> create payload
        self.branches: dict[str, set] = {}  # repo_id -> branch names
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> bytes
        self.commits: list[Commit] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _make_handler(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, so only once started
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def threads(self) -> list[threading.Thread]:
        """This server's threads still alive (none after close())."""
        return [thread for thread in (self._thread, *self._server.handler_threads) if thread.is_alive()]

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    # ---------------------------------------------------------------- routing

    def handle(self, request: Request) -> tuple[int, dict]:
        with self._lock:
            self.requests.append(request)
            method, path = request.method, request.path
            presigned = path.startswith("/lfs-upload/")  # a storage URL: the Hub token is not sent there
            if self.token and not presigned and request.headers.get("authorization") != f"Bearer {self.token}":
                return 401, {"error": "Invalid credentials in Authorization header"}
            if (method, path) == ("POST", "/api/repos/create"):
                return self._create_repo(request.json())
            if (method, path) == ("POST", "/api/validate-yaml"):
                return 200, {"errors": [], "warnings": []}
            if method == "PUT" and presigned:
                return self._lfs_put(path.rsplit("/", 1)[1], request.body)
            if (method, path) == ("POST", "/lfs-verify"):
                body = request.json()
                stored = self.lfs_objects.get(body["oid"])
                return (200, {}) if stored is not None and len(stored) == body["size"] else (404, {"error": "missing"})
            if method == "POST" and (match := _LFS_BATCH.match(path)):
                return self._lfs_batch(match["repo"], request.json())
            if method == "POST" and (match := _REPO_OP.match(path)):
                repo_id, revision = match["repo"], unquote(match["rev"])
                if repo_id not in self.repos:
                    return 404, {"error": f"Repository {repo_id} not found"}
                handler = {"preupload": self._preupload, "commit": self._commit, "branch": self._branch}[match["op"]]
                return handler(repo_id, revision, request)
            return 404, {"error": f"fake hub: {method} {path} is not implemented"}

    def _create_repo(self, payload: dict) -> tuple[int, dict]:
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = {"url": f"{self.endpoint}/{repo_id}"}
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", **url}
        self.repos[repo_id] = payload
        self.branches[repo_id] = {"main"}
        return 200, url

    def _branch(self, repo_id: str, branch: str, request: Request) -> tuple[int, dict]:
        if branch in self.branches[repo_id]:
            return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
        self.branches[repo_id].add(branch)
        return 200, {}

    def _preupload(self, repo_id: str, revision: str, request: Request) -> tuple[int, dict]:
        files = []
        for item in request.json()["files"]:
            binary = b"\0" in base64.b64decode(item["sample"])
            lfs = self.lfs and (item["path"].endswith(LFS_SUFFIXES) or item["size"] >= LFS_MIN_SIZE or binary)
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": None})
        return 200, {"files": files}

    def _lfs_batch(self, repo_id: str, payload: dict) -> tuple[int, dict]:
        if payload.get("operation") != "upload" or "basic" not in payload.get("transfers", []):
            return 400, {"error": "fake hub: only basic LFS uploads are implemented"}
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs_objects:  # already stored: no actions, the client skips the upload
                entry["actions"] = {"upload": {"href": f"{self.endpoint}/lfs-upload/{obj['oid']}"},
                                    "verify": {"href": f"{self.endpoint}/lfs-verify"}}
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, body: bytes) -> tuple[int, dict]:
        if hashlib.sha256(body).hexdigest() != oid:
            return 400, {"error": "sha256 mismatch"}
        self.lfs_objects[oid] = body
        return 200, {}

    def _commit(self, repo_id: str, revision: str, request: Request) -> tuple[int, dict]:
        if revision not in self.branches[repo_id]:
            return 404, {"error": f"Invalid rev id: {revision}"}
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return 400, {"error": "the first ndjson line must be the header"}
        commit = Commit(repo_id, revision, lines[0]["value"]["summary"])
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                commit.files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    return 400, {"error": f"LFS object {value['oid']} for {value['path']} was never uploaded"}
                commit.lfs_files[value["path"]] = (value["oid"], value["size"])
            else:
                return 400, {"error": f"fake hub: unsupported commit line {line['key']}"}
        if request.query.get("create_pr", ["0"])[0] in ("1", "true", "True"):
            commit.pull_request = 1 + sum(c.pull_request is not None for c in self.commits if c.repo_id == repo_id)
        self.commits.append(commit)
        oid = hashlib.sha1(request.body).hexdigest()
        pull_request = None if commit.pull_request is None else \
            f"{self.endpoint}/{repo_id}/discussions/{commit.pull_request}"
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                     "pullRequestUrl": pull_request}


class _Server(http.server.ThreadingHTTPServer):
    """One thread per request, each kept so that server_close() joins them all."""

    def __init__(self, *args):
        self.handler_threads: list[threading.Thread] = []
        super().__init__(*args)

    def process_request(self, request, client_address):
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="fake-hub-request", daemon=True)
        self.handler_threads.append(thread)
        thread.start()

    def server_close(self):
        super().server_close()
        for thread in self.handler_threads:
            thread.join(timeout=5)


def _make_handler(hub: FakeHub):
    class Handler(http.server.BaseHTTPRequestHandler):
        def _serve(self):
            url = urlsplit(self.path)
            request = Request(self.command, url.path, parse_qs(url.query),
                              {k.lower(): v for k, v in self.headers.items()}, self._read_body())
            status, payload = hub.handle(request)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # streamed file uploads
                chunks = []
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def log_message(self, *args):  # keep pytest output clean
            pass

    return Handler
