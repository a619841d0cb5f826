"""Where a run goes: which Ray cluster it joins, and whether its storage reaches every node of it.

``join_check(address)`` asks the cluster's GCS one cheap question (GetClusterId) before ``ray.init``,
in milliseconds, and says what answered:

    "open"   it answered                          -> join
    "token"  it answered with UNAUTHENTICATED      -> join with the token Ray keeps (RAY_AUTH_TOKEN,
                                                      RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token: Ray's own
                                                      loader), in token mode, as ``ray.init("auto")`` does
                                                      for a local cluster; no token, or one it refuses:
                                                      ClusterError with the one-line fix
    "dead"   nothing listens there (UNAVAILABLE)   -> the only answer a caller may call stale
    "?"      anything else (a slow or odd answer)  -> join and let Ray say what is wrong

Without it, a driver with no RAY_AUTH_MODE tries a token cluster for 20 s of ``Unauthenticated``
warnings and then, taking the refusal for a dead cluster, starts a second one of its own.

``check_shared_storage(cfg, node_count)`` refuses, at start, a run on more than one node whose
checkpoints would stay on the node that writes them: ``--storage`` empty (OUTPUT_DIR/ray_storage) or a
local folder that is not on a network filesystem. Ray Train writes each checkpoint from the ranks'
nodes, and restores read it from whichever node the new workers land on.
"""
from __future__ import annotations

import os
from pathlib import Path

from ray_mmbatch.dataflow.pools import ResourceError
from ray_mmbatch.formats import fs

AUTH_MODE = "RAY_AUTH_MODE"
SHARED_ENV = "RAY_MMBATCH_SHARED_STORAGE"  # =1: a local --storage folder is shared, whatever its mount says
TOKEN_FIX = ("copy the cluster's token (`ray get-auth-token` on its head node) to ~/.ray/auth_token, or export "
             "RAY_AUTH_TOKEN=<token> (or RAY_AUTH_TOKEN_PATH=<file>)")
# mount types whose files every node mounting them sees (/proc/mounts' third field)
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "gpfs", "beegfs", "wekafs",
              "efs", "afs", "ocfs2", "gfs2", "fuse.glusterfs", "fuse.cephfs", "fuse.s3fs", "fuse.gcsfuse",
              "fuse.mountpoint-s3", "fuse.juicefs", "fuse.goofys", "fuse.rclone", "fuse.blobfuse2", "fuse.weka"}


class ClusterError(ResourceError):
    """The run cannot go where it was sent (a cluster it may not join, storage one node keeps); str() says the fix.
    A ResourceError: refused at start, before any stream, like a run that cannot be placed (exit 2)."""


def _is_host_port(address: str) -> bool:
    """A GCS address (host:port, [v6]:port); not ray://, http://, 'auto' or 'local'."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit()) and "://" not in address


def _ask(target: str, metadata: list | None, timeout: float) -> str:
    import grpc
    from ray.core.generated import gcs_service_pb2 as pb
    from ray.core.generated import gcs_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            pb_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(pb.GetClusterIdRequest(), timeout=timeout,
                                                                 metadata=metadata)
            return "open"
        except grpc.RpcError as e:
            return {grpc.StatusCode.UNAUTHENTICATED: "token", grpc.StatusCode.UNAVAILABLE: "dead"}.get(e.code(), "?")


def _token_header() -> list | None:
    """[("authorization", "Bearer ...")] from the token Ray would send, or None when there is none."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # RAY_AUTH_TOKEN* may have changed since this process first asked
    header = loader.get_token_for_http_header(ignore_auth_mode=True)
    return list(header.items()) or None


def join_check(address: str, timeout: float = 3.0) -> str:
    """"open", "dead" or "?" for the GCS at ``address`` (module docstring); a token cluster is made "open" by
    switching this process to token mode with the token Ray keeps, or refused with ClusterError."""
    if not _is_host_port(address):
        return "?"
    try:
        answer = _ask(address, None, timeout)
    except ImportError:  # Ray's generated protocol moved: ray.init will say what it says
        return "?"
    if answer != "token":
        return answer
    mode = os.environ.get(AUTH_MODE, "").lower()
    if mode not in ("", "token"):
        raise ClusterError(f"the Ray cluster at {address} requires token authentication but {AUTH_MODE}={mode}: "
                           f"unset it, or export {AUTH_MODE}=token")
    header = _token_header()
    if header is None:
        raise ClusterError(f"the Ray cluster at {address} requires token authentication and this shell has no "
                           f"token: {TOKEN_FIX}")
    if _ask(address, header, timeout) == "token":
        raise ClusterError(f"the Ray cluster at {address} refuses this shell's token (RAY_AUTH_TOKEN, "
                           f"RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): {TOKEN_FIX}")
    if mode != "token":
        from ray._raylet import Config

        os.environ[AUTH_MODE] = "token"  # Ray's own switch (authentication_token_setup._enable_token_auth)
        Config.initialize("")
        print(f"[ray_mmbatch] the cluster at {address} uses token authentication: joining with this shell's "
              "token", flush=True)
    return "open"


def mount_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (its nearest existing folder), from /proc/mounts; ''
    where unknown (no /proc)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, parts[2]
    return kind


def storage_is_shared(location: str) -> bool:
    """A bucket URI, or a local folder on a network filesystem (or one RAY_MMBATCH_SHARED_STORAGE=1 declares shared)."""
    if fs.is_uri(location):
        return True
    return os.environ.get(SHARED_ENV) == "1" or mount_type(fs.local_path(location)) in NETWORK_FS


def check_shared_storage(storage: str, where: str, node_count: int) -> None:
    """ClusterError when the run has more than one node to go to and its checkpoints would stay on one.
    ``storage``: the --storage setting ('' = none); ``where``: the location it resolves to."""
    if node_count <= 1 or storage_is_shared(where):
        return
    what = f"--storage {storage}" if storage else f"checkpoints go to {where} (no --storage)"
    kind = mount_type(fs.local_path(where)) or "unknown"
    raise ClusterError(f"this Ray cluster has {node_count} nodes and {what}, a folder on one node's disk "
                       f"({kind}): each checkpoint would stay on the node that wrote it, and a restart elsewhere "
                       "or `ray down` loses it. Give --storage a bucket (s3://bucket/runs, gs://, abfs://) or a "
                       f"folder every node mounts (NFS, EFS, Lustre; {SHARED_ENV}=1 if yours is shared but "
                       "not listed)")
