"""A test engine with the real tokenizer whose ``step`` raises, or blocks forever, after a few steps.

Shipped to the Ray worker by value (cloudpickle), so the worker needs no access to tests/.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool = False

    def add(self, later, aggregate):  # as vLLM's RequestOutput.add merges deltas
        self.outputs[0].text += later.outputs[0].text
        self.outputs[0].token_ids = self.outputs[0].token_ids + later.outputs[0].token_ids
        self.outputs[0].finish_reason = later.outputs[0].finish_reason
        self.finished = later.finished


@dataclass
class BrokenEngine:
    model_dir: str
    fail_after_steps: int = 3
    hang: bool = False  # block forever (releasing the GIL, as a stuck kernel would) instead of raising
    running: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    _tokenizer: object = None

    def add_request(self, request_id, prompt, params, **options):
        self.running[request_id] = 0

    def step(self):
        self.steps += 1
        if self.steps > self.fail_after_steps:
            if self.hang:
                import threading

                threading.Event().wait()
            raise RuntimeError("simulated engine crash")
        return [_Output(rid, [_Completion("x", [42])]) for rid in self.running]

    def abort_request(self, ids):
        for rid in ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def get_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer


def broken_engine_factory(model_dir: str, fail_after_steps: int = 3, hang: bool = False):
    def factory(deployment, progress):
        return BrokenEngine(model_dir, fail_after_steps, hang)

    return factory
