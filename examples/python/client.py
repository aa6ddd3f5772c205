#!/usr/bin/python3
"""Strata public API client example (proto/strata/v1/api.proto), using Debian's python3-grpcio.

Generates the Python stubs at run time into a temporary directory with Debian's protoc 3.21 and
grpc_python_plugin (packages protobuf-compiler, protobuf-compiler-grpc), then uploads a document,
waits until it is READY (printing prefill progress) and streams the answer to a question.

  /usr/bin/python3 examples/python/client.py --server 127.0.0.1:7070 --doc FILE "question"
  /usr/bin/python3 examples/python/client.py --server 127.0.0.1:7070 --doc-token-ids 1,2,3 --prompt-token-ids 4,5 \
      --max-tokens 8 --json

Run it with /usr/bin/python3 (Debian's interpreter, where python3-grpcio is installed). Every call
sets a deadline (--timeout). With --json the final job (state, output token ids, usage) is printed
to stdout as one JSON line instead of the streamed text.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_ROOT = os.path.join(REPO, "proto")


def load_stubs(out_dir):
    """Runs protoc + grpc_python_plugin on api.proto; returns (api_pb2, api_pb2_grpc)."""
    subprocess.run(
        ["protoc", f"--proto_path={PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_out={out_dir}",
         "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         os.path.join(PROTO_ROOT, "strata/v1/api.proto")],
        check=True)
    sys.path.insert(0, out_dir)
    from strata.v1 import api_pb2, api_pb2_grpc  # noqa: E402 (generated just now)
    return api_pb2, api_pb2_grpc


def parse_ids(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="127.0.0.1:7070")
    ap.add_argument("--doc", help="document text file")
    ap.add_argument("--doc-token-ids", help="document as comma-separated token ids")
    ap.add_argument("--prompt-token-ids", help="prompt as token ids (instead of the question text)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of each call, seconds")
    ap.add_argument("--json", action="store_true", help="print the final job as JSON")
    ap.add_argument("question", nargs="?", default="")
    args = ap.parse_args()
    if bool(args.doc) == bool(args.doc_token_ids):
        ap.error("give --doc or --doc-token-ids")
    if not args.question and not args.prompt_token_ids:
        ap.error("give a question or --prompt-token-ids")

    import grpc  # Debian python3-grpcio
    with tempfile.TemporaryDirectory() as tmp:
        api_pb2, api_pb2_grpc = load_stubs(tmp)
        channel = grpc.insecure_channel(args.server)
        docs = api_pb2_grpc.DocumentServiceStub(channel)
        jobs = api_pb2_grpc.JobServiceStub(channel)

        def upload_requests():
            opts = api_pb2.DocumentUploadOptions(display_name=args.doc or "token ids")
            if args.doc:
                with open(args.doc, encoding="utf-8") as f:
                    yield api_pb2.DocumentUploadRequest(options=opts, text=f.read())
            else:
                yield api_pb2.DocumentUploadRequest(
                    options=opts, tokens=api_pb2.TokenIds(ids=parse_ids(args.doc_token_ids)))

        uploaded = docs.Upload(upload_requests(), timeout=args.timeout)
        doc = uploaded.document
        print(f"document {doc.document_id} ({doc.num_tokens} tokens, created={uploaded.created})", file=sys.stderr)
        if doc.state != api_pb2.DocumentInfo.READY:
            for info in docs.Watch(api_pb2.DocumentWatchRequest(document_id=doc.document_id), timeout=args.timeout):
                p = info.progress
                print(f"prefill {p.tokens_prefilled}/{info.num_tokens} state="
                      f"{api_pb2.DocumentInfo.State.Name(info.state)}", file=sys.stderr)
                if info.state in (api_pb2.DocumentInfo.READY, api_pb2.DocumentInfo.FAILED):
                    break

        req = api_pb2.JobSubmitRequest(
            document_id=doc.document_id,
            params=api_pb2.GenerationParams(max_tokens=args.max_tokens, temperature=0.0),
            policy=api_pb2.SelectionPolicy(name=args.policy))
        if args.prompt_token_ids:
            req.prompt_tokens.ids.extend(parse_ids(args.prompt_token_ids))
        else:
            req.prompt_text = args.question
        final = None
        for event in jobs.Generate(req, timeout=args.timeout):
            kind = event.WhichOneof("event")
            if kind == "tokens" and not args.json:
                sys.stdout.write(event.tokens.text)
                sys.stdout.flush()
            elif kind == "snapshot":
                final = event.snapshot
        if final is None:
            print("no final job snapshot", file=sys.stderr)
            return 1
        u = final.usage
        if args.json:
            print(json.dumps({
                "job_id": final.job_id,
                "state": api_pb2.JobInfo.State.Name(final.state),
                "output_token_ids": list(final.output_token_ids),
                "output_text": final.output_text,
                "usage": {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                          "completion_tokens": u.completion_tokens,
                          "mean_attended_tokens": u.mean_attended_tokens},
            }))
        else:
            print()
            print(f"usage: prompt={u.prompt_tokens} cached={u.cached_tokens} completion={u.completion_tokens} "
                  f"mean_attended={u.mean_attended_tokens:.1f}", file=sys.stderr)
        return 0 if final.state == api_pb2.JobInfo.DONE else 1


if __name__ == "__main__":
    sys.exit(main())
