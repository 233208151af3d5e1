"""`raymesh serve job.toml`: serve a trained checkpoint over HTTP until Ctrl-C (or SIGTERM);
`raymesh serve --hf FOLDER`: serve a Hugging Face folder (`raymesh export --hf`'s) the same way;
`raymesh serve --checkpoint RUN`: serve a checkpoint alone (its job's build function, or the
transformers model it records, rebuilt from that record: raymesh.serve.model);
`raymesh serve reload --checkpoint NEW`: roll a running server to another checkpoint.

    RAYMESH_SERVE_ADMIN_TOKEN=$(openssl rand -hex 16) raymesh serve job.toml \
        --checkpoint-root runs --tls-cert cert.pem --tls-key key.pem
    RAYMESH_SERVE_ADMIN_TOKEN=... raymesh serve reload --checkpoint runs/job-v2 \
        --url https://127.0.0.1:8000 --tls-cert cert.pem
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import threading
import urllib.error
import urllib.request
from typing import Any

from raymesh.cli import errors
from raymesh.cli.args import add_tls_arguments, count_or_range

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a trained checkpoint over HTTP (or: serve reload --checkpoint NEW)",
        description="Serve the model of a job file over HTTP: `raymesh serve job.toml`. "
        "Roll a running server to a new checkpoint: `raymesh serve reload --checkpoint NEW`.",
    )
    p.add_argument("job", nargs="?", help="the TOML job file that trained the model, or `reload`")
    p.add_argument(
        "--hf",
        metavar="FOLDER",
        help="serve this Hugging Face folder (a causal LM or a LoRA adapter, as `raymesh "
        "export --hf` writes it) instead of a job file's model; it generates text",
    )
    p.add_argument(
        "--checkpoint",
        help="checkpoint folder (default: the job's [checkpoint] dir); without a job file, "
        "served alone: a transformers model is rebuilt from what the checkpoint records",
    )
    p.add_argument("--replicas", type=count_or_range, help="N, or MIN:MAX to autoscale")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="port (default 8000; 0: any free port)")
    p.add_argument(
        "--token", help="require this bearer token (default: $RAYMESH_SERVE_TOKEN if set)"
    )
    p.add_argument(
        "--admin-token",
        dest="admin_token",
        help="the token POST /admin/reload needs, and reload sends (default: "
        "$RAYMESH_SERVE_ADMIN_TOKEN; neither: reload is off)",
    )
    p.add_argument(
        "--checkpoint-root",
        dest="checkpoint_root",
        help="POST /admin/reload loads only from under this folder (needed with an admin token)",
    )
    add_tls_arguments(p)  # reload: --tls-cert is the certificate to trust
    p.add_argument("--max-batch-size", type=int, dest="max_batch_size")
    p.add_argument("--batch-wait-ms", type=float, dest="batch_wait_ms")
    p.add_argument(
        "--max-streams",
        type=int,
        dest="max_streams",
        help="generate streams a replica decodes at once, as one batch (default 16; 1: one "
        "at a time)",
    )
    p.add_argument("--backend", choices=["raymesh", "ray-serve"])
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="reload: the server (default %(default)s)"
    )


# The flags that override the job file's [serve] table (and its checkpoint).
_OVERRIDES = (
    "checkpoint",
    "replicas",
    "host",
    "port",
    "token",
    "admin_token",
    "checkpoint_root",
    "max_batch_size",
    "batch_wait_ms",
    "max_streams",
    "backend",
)


def run(args: argparse.Namespace) -> int:
    if args.job == "reload":
        return _reload(args)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return errors.run("serve", lambda: _serve(args, stop))


def _serve(args: argparse.Namespace, stop: threading.Event) -> int:
    from raymesh import serve

    overrides = {k: getattr(args, k) for k in _OVERRIDES}
    overrides["tls"] = serve.Tls.of(args.tls_cert, args.tls_key)
    if args.hf is not None:
        if args.job is not None:
            raise ValueError(f"give a job file ({args.job}) or --hf FOLDER, not both")
        # No job file: the flags are the whole [serve] table, and the folder is the model.
        model = {"hf": args.hf, "checkpoint": overrides.pop("checkpoint")}
        config = serve.ServeConfig.from_dict({k: v for k, v in overrides.items() if v is not None})
        what = f"hf folder {args.hf}"
    elif args.job is None and args.checkpoint is not None:
        # A checkpoint alone: its job's build function if that imports, else its record.
        model = {"checkpoint": overrides.pop("checkpoint")}
        config = serve.ServeConfig.from_dict({k: v for k, v in overrides.items() if v is not None})
        what = f"checkpoint {args.checkpoint}"
    elif args.job is None:
        raise ValueError(
            "give a job file (raymesh serve job.toml), --checkpoint RUN or --hf FOLDER"
        )
    else:
        model, config = serve.load_serving(args.job, **overrides)
        what = f"checkpoint {model.get('checkpoint')}"
    app = serve.deploy(config=config, **model)
    print(
        f"serving {app.url} ({config.replicas} replica(s); {what}); Ctrl-C to stop",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        app.stop()
    print("stopped", flush=True)
    return 0


def _reload(args: argparse.Namespace) -> int:
    from raymesh.serve import ADMIN_TOKEN_ENV

    def refuse(why: str) -> int:
        return errors.say("serve reload", why, errors.USAGE)

    if not args.checkpoint:
        return refuse("give --checkpoint NEW")
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        return refuse(f"give the server's admin token: --admin-token or ${ADMIN_TOKEN_ENV}")
    if args.tls_key:
        return refuse("--tls-key is the server's; reload takes --tls-cert, the cert to trust")
    https = args.url.startswith("https://")
    if args.tls_cert and not https:
        return refuse(f"--tls-cert trusts an HTTPS server: give its https:// URL, not {args.url}")
    # The server's own certificate (a self-signed one) or its CA, else the system's CAs.
    context = ssl.create_default_context(cafile=args.tls_cert) if https else None
    request = urllib.request.Request(
        args.url.rstrip("/") + "/admin/reload",
        data=json.dumps({"checkpoint": os.path.abspath(args.checkpoint)}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=600, context=context) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        return errors.say("serve reload", f"HTTP {e.code}: {detail}", errors.FAILED)
    except (urllib.error.URLError, OSError) as e:
        return errors.say("serve reload", f"cannot reach {args.url}: {e}", errors.FAILED)
    print(f"reloaded: {body['replicas']} replica(s) serve {body['checkpoint']}")
    return 0
