"""find_micro_batch_size on a real model, up to a real out-of-memory error.

    python -m benchmarks.find_batch [--global-batch 256] [--candidates 4,8,16,32,64,128,256]
                                    [--out PATH]

GPT-2 small (bench_train.make_model: bf16, seq 1024 on GPU; a tiny one on the CPU) wrapped in
AccumulatingOptimizer(AdamW); train_step(m) runs forward + backward of m random sequences (the
wrapper moves the gradients into its fp32 window). On an 80 GB GPU the largest candidates do not
fit: the table shows where torch.OutOfMemoryError stopped the search, the samples/s and peak
memory of every size that fit, and the size chosen. Writes a JSON record (default
benchmarks/results/find-batch-<device-slug>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench.env import default_out_path, environment
from benchmarks.accumbench.report import json_safe
from benchmarks.bench_train import make_model


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--global-batch", type=int, default=256 if gpu else 8)
    p.add_argument("--candidates", default="4,8,16,32,64,128,256" if gpu else "1,2,4,8")
    p.add_argument("--seq", type=int, default=1024 if gpu else 32)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    small = device.type == "cpu"
    torch.manual_seed(0)
    model = make_model("gpt2", 2 if small else 12, 64 if small else 768, 4 if small else 12,
                       256 if small else 50257, args.seq).to(device)
    vocab = model.config.vocab_size
    opt = accumkernels.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def train_step(m: int) -> None:
        tokens = torch.randint(vocab, (m, args.seq), device=device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.reset_window()

    candidates = [int(c) for c in args.candidates.split(",") if c]
    result = accumkernels.find_micro_batch_size(train_step, args.global_batch,
                                                candidates=candidates)
    print(result)
    env = environment(device)
    record = {"benchmark": "find_micro_batch_size", "schema_version": 1, "environment": env,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv),
              "config": {"model": "gpt2", "seq": args.seq, "global_batch": args.global_batch,
                         "candidates": candidates, "dtype": "bf16",
                         "params": sum(q.numel() for q in model.parameters())},
              "micro_batch_size": result.micro_batch_size,
              "accumulation_steps": result.accumulation_steps, "table": result.table,
              "hit_oom": any("out of memory" in r["note"] for r in result.table)}
    out = args.out or default_out_path("find-batch-" + env["device_slug"], datetime.date.today(),
                                       False, False)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(record), indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
