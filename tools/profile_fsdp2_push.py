"""Where the colocated FSDP2 push's time goes (GPU): ``FSDP2Source.gathered`` over every bucket alone, then the
whole ``push_colocated`` (gathering ahead) with the engine's per-bucket split (seconds, open, load, flush), for
1 GiB and 4 GiB buckets, on a one-rank FSDP2 model with a preset's shapes. (The gathered buckets share two
buffer sets, so they cannot all be gathered first and pushed after.)

    python tools/profile_fsdp2_push.py [--preset llama-3.1-8b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from benchmarks.colocated_push import _module_of, trainer_tensors
    from benchmarks.presets import write_preset
    from rollout import Engine
    from rollout.ipc import free_port
    from trainer_adapters import push_colocated
    from trainer_adapters.senders import param_source

    path = write_preset(args.preset)
    with Engine(path, dtype="bfloat16", device="cuda", max_total_tokens=1024, skip_tokenizer_init=True,
                load_format="dummy") as engine:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        module = _module_of(trainer_tensors(path, "cuda", torch.bfloat16))
        for child in module.children():
            fully_shard(child)
        fully_shard(module)
        source = param_source(module)
        for bucket_bytes in (1 << 30, 4 << 30):
            plan = source.plan("bucket", bucket_bytes, None)
            print(f"{len(plan)} buckets of at most {bucket_bytes >> 20} MiB")
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _bucket in source.gathered(plan):
                    pass
                torch.cuda.synchronize()
                gather = time.perf_counter() - t
                t = time.perf_counter()
                res = [r[0] for r in push_colocated(module, [engine], bucket_bytes=bucket_bytes)["results"]]
                push = time.perf_counter() - t
                split = {k: [round(r.get(k, 0.0) * 1e3, 1) for r in res[:6]] for k in ("seconds", "open_s", "load_s",
                                                                                     "flush_s")}
                print(f"  gather all alone {gather * 1e3:.1f} ms; push_colocated {push * 1e3:.1f} ms; "
                      f"engine per bucket (first 6, ms): {split}")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
