"""Runs under torchrun for the distributed tests: several training runs in one process group.

    torchrun --nproc_per_node 2 tests/dist_worker.py SPEC.json OUT_DIR

SPEC.json: a list of {"name", "args": [override, ...], "grad_check": bool, "save_params": bool}.
For each run, rank 0 writes OUT_DIR/NAME.pt with the per-step losses and, as asked, the
full gradients of one fixed batch (before training) and the final full parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from nsa_titan.config import load_config
from nsa_titan.runtime.diagnostics import clean_name, missing_grads
from nsa_titan.distributed.parallel import device_for_rank, init_distributed
from nsa_titan.system.cli import setup_logging
from nsa_titan.train import Trainer

def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def fixed_batch(cfg, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch outside the data stream, different per rank, same for every run."""
    gen = torch.Generator().manual_seed(99 + rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.local_batch_size, cfg.training.seq_len + 1),
                           generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def run(spec: dict, out_dir: Path) -> None:
    cfg, _ = load_config(spec["args"])
    trainer = Trainer(cfg)
    result: dict = {
        "name": spec["name"],
        "placements": {clean_name(n): [str(pl) for pl in p.placements] if isinstance(p, DTensor) else None
                       for n, p in trainer.model.named_parameters()},
    }
    try:
        if spec.get("grad_check"):
            inputs, labels = fixed_batch(cfg, trainer.rank)
            loss = trainer.forward_backward(inputs.to(trainer.device), labels.to(trainer.device))
            dist.all_reduce(loss)
            result["grad_loss"] = loss.item() / trainer.world_size
            named = [(clean_name(n), p) for n, p in trainer.model.named_parameters()]
            result["missing_grads"] = [n for n, p in named if p.grad is None]
            result["missing_report"] = missing_grads(trainer.model)  # the [debug] report's own check
            result["grads"] = {n: full(p.grad) for n, p in named if p.grad is not None}
            trainer.optimizer.zero_grad(set_to_none=True)
        history = trainer.train()
        result["losses"] = [s.loss for s in history]
        result["steps"] = [s.step for s in history]
        result["grad_norms"] = [s.grad_norm for s in history]
        if spec.get("save_sync_and_async"):  # the same state, saved both ways
            ck = trainer.checkpointer
            for mode in ("disabled", "async"):
                ck.cfg.async_mode, ck.folder = mode, out_dir / f"{spec['name']}-{'sync' if mode == 'disabled' else mode}"
                ck.maybe_save(trainer.state.step, force=True)
                ck.wait()
        if spec.get("save_params"):
            result["params"] = {clean_name(n): full(p) for n, p in trainer.model.named_parameters()}
        if spec.get("rank_bytes"):  # what this rank really holds: parameter shards, AdamW state
            local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
            params = sum(local(p).numel() * local(p).element_size() for p in trainer.model.parameters())
            state = sum(local(v).numel() * local(v).element_size() for st in trainer.optimizer.state.values()
                        for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            result["rank_bytes"] = {"params": params, "optimizer": state}
        if spec.get("save_optimizer"):
            opt = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            result["optimizer"] = {f"{name}.{k}": full(v) for name, st in opt.get("state", {}).items() for k, v in st.items()}  # rank 0 only
            result["step"] = trainer.state.step
    finally:
        trainer.close()
    if trainer.rank == 0:
        torch.save(result, out_dir / f"{spec['name']}.pt")


def main() -> None:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    setup_logging()
    # Many models compiled in one process: allow the recompiles this causes.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    init_distributed(device_for_rank())
    for spec in json.loads(spec_path.read_text()):
        run(spec, out_dir)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
