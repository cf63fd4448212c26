#!/usr/bin/env python3
"""Claims, renews and releases a task's lease on an automaton coordinator.

    python3 automaton_client.py ADDRESS TASK AGENT      e.g. 127.0.0.1:7070 fix-login agent-a

Needs `pip install grpcio grpcio-tools`. The stubs are generated from proto/ (next to this
file's docs/ folder, or AUTOMATON_PROTO) into a temporary directory at each run.
AUTOMATON_TOKEN, when set, is sent as the bearer token.
"""

import importlib
import importlib.resources
import os
import pathlib
import sys
import tempfile
import time

import grpc
from google.protobuf.duration_pb2 import Duration
from grpc_tools import protoc


def load_stubs(out):
    """Generates the automaton.v1 stubs into `out` and imports them."""
    here = pathlib.Path(__file__).resolve().parent
    proto = pathlib.Path(os.environ.get("AUTOMATON_PROTO", here.parent.parent / "proto"))
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    rc = protoc.main([
        "protoc", f"-I{proto}", f"-I{well_known}",
        f"--python_out={out}", f"--grpc_python_out={out}",
        "automaton/v1/automaton.proto",
    ])
    if rc != 0:
        sys.exit(f"ERROR: cannot compile {proto}/automaton/v1/automaton.proto. "
                 "Point AUTOMATON_PROTO at the repository's proto/ folder.")
    sys.path.insert(0, out)
    return (importlib.import_module("automaton.v1.automaton_pb2"),
            importlib.import_module("automaton.v1.automaton_pb2_grpc"))


def show(what, lease):
    print(f"{what} {lease.task} lease {lease.lease_id} token {lease.token} "
          f"ttl {lease.ttl.ToTimedelta().total_seconds():g}s "
          f"expires {lease.expires_at.ToJsonString()}", flush=True)


def main(address, task, agent):
    with tempfile.TemporaryDirectory() as out:
        pb, rpc = load_stubs(out)
        token = os.environ.get("AUTOMATON_TOKEN")
        auth = [("authorization", f"Bearer {token}")] if token else []
        with grpc.insecure_channel(address) as channel:
            leases = rpc.LeasesStub(channel)
            try:
                lease = leases.Claim(pb.ClaimRequest(task=task, agent=agent,
                                                     ttl=Duration(seconds=30)),
                                     metadata=auth, timeout=10)
                show("claimed", lease)
                time.sleep(1.5)  # so that the renewal visibly moves the expiry
                lease = leases.Renew(pb.RenewRequest(lease_id=lease.lease_id, token=lease.token),
                                     metadata=auth, timeout=10)
                show("renewed", lease)
                gone = leases.Release(pb.ReleaseRequest(lease_id=lease.lease_id,
                                                        token=lease.token, agent=agent),
                                      metadata=auth, timeout=10)
                show("released", gone.released)
            except grpc.RpcError as e:
                kind = dict(e.trailing_metadata() or ()).get("automaton-error-kind", "")
                sys.exit(f"ERROR: {e.code().name} ({kind}): {e.details()}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} ADDRESS TASK AGENT   (e.g. 127.0.0.1:7070 fix-login agent-a)")
    main(*sys.argv[1:])
