"""lm-evaluation-harness on an nsa_titan model in this process: `TitanLM`, the harness's loglikelihood
interface over the model (the training model under FSDP and context parallelism too), and `Harness`.

Under torchrun the requests are shared out among the data-parallel ranks (the harness's own `rank` /
`world_size` split, its padding to equal counts), every rank running as many forwards as the others (each is
collective under FSDP), and the results gathered: the figures equal one process's.

It scores as the harness scores a Hugging Face export of the model (`--model hf`): a context and its
continuation tokenized whole, the prompt's trailing spaces moved to the continuation, an empty context
replaced by the prefix token (bos, else eos), at most seq_len tokens read; rolling perplexity in the
windows of `rolling_windows`. Generation tasks are not run here (use the export: docs/huggingface.md)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError
from ..data import Tokenizer
from ..data.batch import document_ids
from ..system.extras import require_lm_eval


def rolling_windows(ids: list[int], prefix: int, seq_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """(inputs, targets): windows that score every token of `ids` once, the last len(targets) logits of
    `inputs` predicting `targets`; the first reads `prefix` then ids, each later one the seq_len tokens
    before its last target (lm-evaluation-harness's rolling windows with a context of 1)."""
    if not ids:
        return
    first = min(seq_len, len(ids))
    yield [prefix] + ids[:first - 1], ids[:first]
    done = first
    while done < len(ids):
        end = min(len(ids), done + seq_len)
        yield ids[end - seq_len - 1:end - 1], ids[done:end]
        done = end


@torch.no_grad()
def score(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], eos: int | None, device: torch.device,
          batch_size: int = 1, forwards: int = 0) -> list[tuple[float, bool]]:
    """Per row (inputs, targets): the log-probability of `targets` and whether each is the argmax, the last
    len(targets) logits of `inputs` predicting them; documents split at `eos` (None: one document). Rows go
    `batch_size` at a time, longest first, each padded at its end, which no earlier position reads (the
    model is causal); then forwards of a one-token row, scored for nothing, up to `forwards` in all (the other
    ranks' count). Under context parallelism every rank of the group passes the same rows."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    for _ in range(forwards - -(-len(rows) // batch_size)):
        model(torch.zeros(1, 1, dtype=torch.long, device=device))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = len(rows[chunk[0]][0])
        x = torch.tensor([rows[i][0] + [0] * (width - len(rows[i][0])) for i in chunk], device=device)
        logits = model(x, document_ids(x.cpu(), None, eos))
        if getattr(model, "cp", None) is not None:
            logits = model.cp.gather(logits)[:, :width]
        for row, i in zip(logits, chunk):
            inputs, targets = rows[i]
            logp = torch.log_softmax(row[len(inputs) - len(targets):len(inputs)].float(), -1)
            want = torch.tensor(targets, device=logp.device)
            out[i] = float(logp.gather(-1, want[:, None]).sum()), bool((logp.argmax(-1) == want).all())
    return out


def titan_lm(model: torch.nn.Module, tokenizer: Tokenizer, seq_len: int, eos: int | None, device: torch.device,
             batch_size: int, dp_rank: int = 0, dp_world: int = 1, scored: list[int] | None = None) -> Any:
    """The harness's LM over `model`: windows of at most `seq_len` tokens, `batch_size` rows a forward,
    documents split at `eos`; data-parallel rank `dp_rank` of `dp_world` (the context-parallel ranks of a group,
    neighbours, pass the same requests). `scored` counts the requests this rank scored."""
    from lm_eval.api.model import TemplateLM

    replicas = dist.get_world_size() // dp_world if dist.is_initialized() else 1
    counted = scored if scored is not None else []

    def agreed_forwards(rows: int) -> int:
        """The most forwards any rank needs for its `rows`, which every rank then runs."""
        n = torch.tensor([-(-rows // batch_size)], device=device)
        if dp_world > 1:
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item())

    class TitanLM(TemplateLM):
        backend = "causal"

        @property
        def rank(self) -> int:
            return dp_rank

        @property
        def world_size(self) -> int:
            return dp_world

        @property
        def device(self) -> torch.device:
            return device

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(out, tensor)
            return torch.stack(out[::replicas])

        def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out[::replicas]

        def barrier(self) -> None:
            dist.barrier()

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_id

        @property
        def prefix_token_id(self) -> int:
            return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return tokenizer.encode(string)

        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=True)  # no bar a rank

        def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[float, bool]]:
            rows = [((context + continuation)[-(seq_len + 1):][:-1], continuation) for _, context, continuation in requests]
            counted.append(len(requests))
            return score(model, rows, eos, device, batch_size, agreed_forwards(len(rows)))

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            windows = [list(rolling_windows(tokenizer.encode(r.args[0]), self.prefix_token_id, seq_len)) for r in requests]
            rows = [w for each in windows for w in each]
            counted.append(len(requests))
            scores = iter(score(model, rows, eos, device, batch_size, agreed_forwards(len(rows))))
            return [sum(next(scores)[0] for _ in each) for each in windows]

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            raise ValueError("lm-eval generation tasks (generate_until) are not run inside nsa_titan: evaluate "
                             "them on the Hugging Face export (docs/huggingface.md)")

    return TitanLM()


class Harness:
    """The harness's tasks of a run, their index built once (`lm_eval.tasks.TaskManager`)."""

    def __init__(self, tasks: list[str], include_path: str, limit: int):
        require_lm_eval("lm-eval tasks")
        from lm_eval.tasks import TaskManager

        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on task YAML defaults, on every rank
        self.tasks, self.limit = tasks, limit or None
        self.scored: list[int] = []  # the requests each data-parallel rank scored in the last run
        self.manager = TaskManager(include_path=include_path or None)
        unknown = [t for t in tasks if t not in self.manager.all_tasks]
        if unknown:
            raise ConfigError(f"lm-eval tasks {unknown} are not known to lm-eval"
                              f"{' nor in ' + include_path if include_path else ''}: check the names, or give the "
                              f"folder of their YAML files ([eval] lm_eval_include_path / --include_path)")
        leaves = self.manager.load(tasks)["tasks"]  # a group's tasks, each on its own
        if generating := sorted(n for n, t in leaves.items() if t.get_config("output_type") == "generate_until"):
            raise ConfigError(f"lm-eval tasks {generating} generate text, which nsa_titan does not run in-process: "
                              f"leave them out here and run them with lm_eval on the Hugging Face export "
                              f"(docs/huggingface.md)")

    def run(self, model: torch.nn.Module, tokenizer: Tokenizer, seq_len: int, eos: int | None, device: torch.device,
            batch_size: int, dp_rank: int = 0, dp_world: int = 1) -> dict[str, float]:
        """{'task/metric': value} of every task (no stderr), `batch_size` rows a forward, the requests shared
        out among the `dp_world` data-parallel ranks (every rank gets the figures); the callers' random states
        left as they were (the harness seeds its own); `self.scored`: the requests each data-parallel rank scored."""
        from lm_eval import evaluator

        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:  # simple_evaluate's seeds and task settings, without its environment report (slow) on every rank
            random.seed(0)
            np.random.seed(1234)
            torch.manual_seed(1234)
            loaded = self.manager.load(self.tasks)
            for task in loaded["tasks"].values():
                if task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=1234)
            mine: list[int] = []
            lm = titan_lm(model, tokenizer, seq_len, eos, device, batch_size, dp_rank, dp_world, mine)
            out = evaluator.evaluate(lm=lm, task_dict=loaded, limit=self.limit, bootstrap_iters=0, log_samples=False,
                                     verbosity="ERROR")  # the results on rank 0, None on the others
            shared = [out["results"] if out else None, sum(mine)]
            if dp_world > 1:
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, shared)
                shared = [every[0][0], [n for _, n in every[::dist.get_world_size() // dp_world]]]
            results, self.scored = shared[0], shared[1] if dp_world > 1 else [shared[1]]
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        return {f"{task}/{name.removesuffix(',none')}": float(value) for task, metrics in results.items()
                for name, value in metrics.items()
                if isinstance(value, (int, float)) and "stderr" not in name and name not in ("alias", "sample_len")}
