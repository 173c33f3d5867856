"""A real vLLM ``LLMEngine`` (the emulated one: vLLM's front half over a timed core) whose core
raises, or blocks forever, after a few steps with output: an engine failing for real, under
vLLM's own serving layer, as a crashed or wedged GPU core would."""

from __future__ import annotations

import threading

STEP_S = 0.01


def broken_engine_factory(model_dir: str, fail_after_steps: int = 3, hang: bool = False):
    """A ``VllmBackend`` engine factory (``VllmBackend.factory(...)``)."""

    def factory(deployment, progress):
        from atomr_infer.engine.vllm.emulated import emulated_engine

        engine = emulated_engine(model_dir, STEP_S)
        core = engine.engine_core
        take = core.get_output
        steps = [0]

        def get_output():
            out = take()
            steps[0] += bool(out.outputs)
            if steps[0] > fail_after_steps:
                if hang:  # as a stuck kernel would: the GIL is released, the step never returns
                    threading.Event().wait()
                raise RuntimeError("simulated engine crash")
            return out

        core.get_output = get_output
        return engine

    return factory
