"""LoRA adapters without an engine: the spec, what restarts, the engine arguments, how a
request's ``model`` names an adapter, what a key may use, and a replica's adapter set."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from atomr_infer.control.plan import plan_apply
from atomr_infer.engine.vllm.engine_args import engine_args
from atomr_infer.models.adapters import adapter_problems
from atomr_infer.replica.adapters import AdapterSet
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.serve.api_keys import ApiKey
from atomr_infer.spec import Deployment

from .hub_cache import fake_snapshot

BASE = {"name": "tuned", "model": "bundled:smollm2-135m-instruct", "device": "cpu"}


def spec(**lora) -> Deployment:
    return Deployment.model_validate({**BASE, "lora": lora})


def test_adapters_change_in_place_and_lora_settings_roll():
    one = spec(adapters={"pirate": "/a/pirate"}, max_loras=2)
    two = spec(adapters={"pirate": "/a/pirate", "robot": "/a/robot"}, max_loras=2)
    assert [a.kind for a in plan_apply(one, two).actions] == ["update_in_place"]
    assert [a.kind for a in plan_apply(one, spec(adapters={"pirate": "/a/pirate"}, max_loras=4)).actions] == ["roll"]
    assert [a.kind for a in plan_apply(Deployment.model_validate(BASE), one).actions] == ["roll"]  # LoRA on


def test_lora_sets_vllms_engine_arguments():
    args = engine_args(spec(adapters={}, max_loras=2, max_lora_rank=8), "/m", "cpu", native_bf16=True)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 8)
    assert "max_cpu_loras" not in args
    assert "enable_lora" not in engine_args(Deployment.model_validate(BASE), "/m", "cpu", native_bf16=True)


@pytest.mark.parametrize("adapters, message", [
    ({"Pirate": "/a"}, "'Pirate' is not a valid adapter name"),
    ({"pirate": "./adapters/pirate"}, "is neither an absolute path of a local directory nor a Hugging Face repo id"),
])
def test_a_bad_adapter_is_one_clear_error(adapters, message):
    with pytest.raises(ValidationError, match=message):
        spec(adapters=adapters)


def test_a_local_adapter_is_checked_against_the_rank_vllm_allocates(tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 32}))
    (tmp_path / "empty").mkdir()
    lora = spec(adapters={"big": str(tmp_path / "big"), "empty": str(tmp_path / "empty"), "far": "/not/here"}).lora
    assert dict(adapter_problems(lora.adapters, lora.max_lora_rank)) == {
        "lora.adapters.big": "rank 32 is over lora.max_lora_rank 16",
        "lora.adapters.empty": f"{str(tmp_path / 'empty')!r} has no readable adapter_config.json (FileNotFoundError)",
    }  # one not on this node is the replicas' to find


def test_the_apply_time_check_refuses_what_vllm_refuses_at_load(tmp_path):
    """A rank_pattern above the limit, or trained biases, passed apply, then failed to load on every
    replica (naming vLLM's flag, not the spec's field)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    peft = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    configs = {"patterned": {**peft, "rank_pattern": {"q_proj": 64}}, "biased": {**peft, "bias": "all"},
               "fine": {**peft, "rank_pattern": {"q_proj": 16}}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
    lora = spec(adapters={name: str(tmp_path / name) for name in configs}).lora
    problems = dict(adapter_problems(lora.adapters, lora.max_lora_rank))
    assert problems == {
        "lora.adapters.patterned": "rank 64 is over lora.max_lora_rank 16",
        "lora.adapters.biased": f"{str(tmp_path / 'biased')!r} trains biases (bias: 'all'), which vLLM does not serve",
    }
    for name, config in configs.items():  # vLLM's own check, at load, agrees
        try:
            PEFTHelper.from_dict(config).validate_legal(LoRAConfig(max_lora_rank=16))
            refused = False
        except ValueError:
            refused = True
        assert refused == (f"lora.adapters.{name}" in problems), name


def safetensors_file(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header, which is all the apply-time check reads."""
    header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
                         for name, shape in shapes.items()}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def lora_dir(root: Path, name: str, modules: dict[str, tuple[int, int]], rank: int = 8) -> Path:
    """A PEFT adapter of ``rank`` adapting each module (path -> (inputs, outputs)) of ``modules``."""
    (root / name).mkdir()
    (root / name / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj"]}))
    shapes = {}
    for module, (inputs, outputs) in modules.items():
        shapes[f"base_model.model.{module}.lora_A.weight"] = [rank, inputs]
        shapes[f"base_model.model.{module}.lora_B.weight"] = [outputs, rank]
    safetensors_file(root / name / "adapter_model.safetensors", shapes)
    return root / name


def test_a_local_adapter_is_checked_against_the_base_models_modules_and_sizes(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    safetensors_file(base / "model.safetensors", {
        "model.embed_tokens.weight": [49152, 576], "model.layers.0.self_attn.q_proj.weight": [576, 576],
        "model.layers.0.self_attn.v_proj.weight": [192, 576], "model.norm.weight": [576]})
    fits = lora_dir(tmp_path, "fits", {"model.layers.0.self_attn.q_proj": (576, 576),
                                       "model.layers.0.self_attn.v_proj": (576, 192)})
    gpt2 = lora_dir(tmp_path, "gpt2", {"transformer.h.0.attn.c_attn": (768, 2304)})
    bigger = lora_dir(tmp_path, "bigger", {"model.layers.0.self_attn.q_proj": (4096, 4096)})
    narrower = lora_dir(tmp_path, "narrower", {"model.layers.0.self_attn.v_proj": (576, 1024)})
    adapters = {"fits": str(fits), "gpt2": str(gpt2), "bigger": str(bigger), "narrower": str(narrower)}
    problems = dict(adapter_problems(adapters, 16, base_model=base))
    assert problems == {
        "lora.adapters.gpt2": f"{str(gpt2)!r} adapts transformer.h.0.attn.c_attn, a module the base model does "
                              "not have (its modules: embed_tokens, lm_head, norm, q_proj, v_proj)",
        "lora.adapters.bigger": f"{str(bigger)!r} adapts model.layers.0.self_attn.q_proj for 4096 inputs; "
                                "the base model's has 576",
        "lora.adapters.narrower": f"{str(narrower)!r} adapts model.layers.0.self_attn.v_proj for 1024 outputs; "
                                  "the base model's has 192",
    }
    # Without the base model's weights on this node only the rank is checked; a quantized base's
    # tensors are packed (GPTQ's qweight, bitsandbytes' uint8 weight): not the modules' own names and sizes.
    assert adapter_problems(adapters, 16) == []
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    safetensors_file(packed / "model.safetensors", {"model.layers.0.self_attn.q_proj.qweight": [72, 576]})
    assert adapter_problems(adapters, 16, base_model=packed) == []


def test_malformed_adapter_or_base_model_files_are_one_line_problems_or_skipped(tmp_path):
    """JSON of another shape in an adapter's or the base model's files crashed `atomr validate`
    with an AttributeError. An adapter's is a problem naming the field and the file; the base
    model's cannot be told apart from a model the loader will refuse, so the check reads what it can."""
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "adapter_config.json").write_text("[1]")
    odd = lora_dir(tmp_path, "odd", {"model.layers.0.self_attn.q_proj": (576, 576)})
    header = b'{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 5}'
    (odd / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    fits = lora_dir(tmp_path, "fits", {"model.layers.0.self_attn.q_proj": (576, 576)})
    gpt2 = lora_dir(tmp_path, "gpt2", {"transformer.h.0.attn.c_attn": (768, 2304)})
    adapters = {"listed": str(listed), "odd": str(odd), "fits": str(fits), "gpt2": str(gpt2)}
    for config in ("[]", '{"text_config": null}', '{"text_config": []}'):
        base = tmp_path / "base"
        base.mkdir(exist_ok=True)
        (base / "config.json").write_text(config)
        safetensors_file(base / "model.safetensors", {"model.layers.0.self_attn.q_proj.weight": [576, 576]})
        problems = dict(adapter_problems(adapters, 16, base_model=base))
        assert problems == {
            "lora.adapters.listed": f"{str(listed)!r} has an adapter_config.json that is not a JSON object (a list)",
            "lora.adapters.odd": f"{str(odd)!r} has an unreadable adapter_model.safetensors (tensor "
                                 "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' is not an object "
                                 "with a dtype and a list of sizes as its shape: 5)",
            "lora.adapters.gpt2": f"{str(gpt2)!r} adapts transformer.h.0.attn.c_attn, a module the base model does "
                                  "not have (its modules: lm_head, q_proj)",
        }, config
    for weights in (b"[1, 2]", b'{"model.norm.weight": {"dtype": ["F32"], "shape": [4]}}'):
        (base / "model.safetensors").write_bytes(len(weights).to_bytes(8, "little") + weights)
        # Base weights it cannot read: only what the adapters' own files tell.
        assert set(dict(adapter_problems(adapters, 16, base_model=base))) == {"lora.adapters.listed"}


def test_the_spec_check_refuses_an_adapter_for_another_model_at_apply(tmp_path):
    from atomr_infer.engine.vllm.spec_check import check_spec
    from atomr_infer.errors import SpecError
    from atomr_infer.models.estimate import local_model_dir

    if local_model_dir(BASE["model"]) is None:
        pytest.skip("the bundled model is not converted on this machine (make setup converts it)")
    gpt2 = lora_dir(tmp_path, "gpt2", {"transformer.h.0.attn.c_attn": (768, 2304)})
    with pytest.raises(SpecError, match=r"lora\.adapters\.chat.*adapts transformer\.h\.0\.attn\.c_attn, a module"):
        check_spec(spec(adapters={"chat": str(gpt2)}))


def test_an_adapter_from_a_hub_repo_id_resolves_from_the_hub_cache_with_one_line_errors(offline_hub):
    from atomr_infer.errors import ModelError
    from atomr_infer.models.adapters import resolve_adapter

    snapshot = fake_snapshot(offline_hub, "acme/pirate-lora", {"adapter_config.json": json.dumps({"r": 32}),
                                                               "adapter_model.safetensors": "weights"})
    fake_snapshot(offline_hub, "acme/no-weights", {"adapter_config.json": "{}"})
    lora = spec(adapters={"pirate": "acme/pirate-lora", "far": "acme/not-cached"}).lora
    assert resolve_adapter("acme/pirate-lora") == snapshot
    assert resolve_adapter("/srv/a") == Path("/srv/a")  # a path is the replica's to find
    # Checked at apply where the cache has it; one not fetched yet is the replicas' to fetch.
    problems = dict(adapter_problems(lora.adapters, lora.max_lora_rank))
    assert problems == {"lora.adapters.pirate": "rank 32 is over lora.max_lora_rank 16"}
    with pytest.raises(ModelError, match=r"^adapter 'acme/not-cached': weights for acme/not-cached are not in "
                                         r"the HF cache .* and HF_HUB_OFFLINE is set \(hint: "):
        resolve_adapter("acme/not-cached")
    with pytest.raises(ModelError, match="^adapter 'acme/no-weights': the snapshot at .* has no adapter_model"):
        resolve_adapter("acme/no-weights")


def test_a_replica_reports_an_adapter_it_cannot_fetch_by_name_and_reason(offline_hub):
    from atomr_infer.models.adapters import resolve_adapter

    loaded = []

    async def load(name, path):
        loaded.append((name, path))

    async def main():
        adapters = AdapterSet("tuned", load, lambda name: asyncio.sleep(0), resolve_adapter)
        await asyncio.gather(*adapters.sync({"pirate": str(offline_hub / "p"), "gone": "acme/gone"}))
        return adapters.states

    states = asyncio.run(main())
    assert loaded == [("tuned:pirate", str(offline_hub / "p"))]
    assert states["pirate"] == "loaded" and states["gone"].startswith("failed: adapter 'acme/gone': weights for")


def test_a_model_names_a_deployment_or_one_of_its_adapters():
    table = RoutingTable(1, {
        "tuned": DeploymentRoute("tuned", 8, "queue", (), ("t",), adapters=("pirate", "robot")),
        "other": DeploymentRoute("other", 8, "queue", (), adapters=("robot",)),
    })
    resolved = {m: (d.name if d else None, a) for m in ("tuned", "t", "tuned:pirate", "t:robot", "pirate", "robot",
                                                          "tuned:nope", "nope")
                for d, a in [table.resolve(m)]}
    assert resolved == {
        "tuned": ("tuned", None), "t": ("tuned", None), "tuned:pirate": ("tuned", "pirate"),
        "t:robot": ("tuned", "robot"), "pirate": ("tuned", "pirate"),
        "robot": (None, None),  # two deployments have one: the bare name is ambiguous
        "tuned:nope": ("tuned", "nope"), "nope": (None, None),  # the router says the adapter is missing
    }


def test_a_key_may_use_the_adapters_of_the_deployments_it_lists_or_the_adapters_it_lists():
    whole, one = ApiKey("a", frozenset({"tuned"})), ApiKey("b", frozenset({"tuned:pirate"}))
    assert whole.may_use("tuned:robot") and whole.may_use("tuned")
    assert one.may_use("tuned:pirate") and not one.may_use("tuned:robot") and not one.may_use("tuned")


def test_a_replica_loads_and_unloads_to_match_and_reports_each_adapter():
    calls = []

    async def load(name, path):
        calls.append(("load", name, path))
        if "broken" in path:
            raise RuntimeError("no adapter_config.json")

    async def unload(name):
        calls.append(("unload", name))

    async def main():
        adapters = AdapterSet("tuned", load, unload)
        await asyncio.gather(*adapters.sync({"pirate": "/a/p", "robot": "/a/broken"}))
        first = dict(adapters.states)
        assert adapters.sync({"pirate": "/a/p", "robot": "/a/broken"}) == []  # nothing to do, nothing retried
        await asyncio.gather(*adapters.sync({"pirate": "/a/p2"}))
        return first, dict(adapters.states)

    first, then = asyncio.run(main())
    assert first == {"pirate": "loaded", "robot": "failed: no adapter_config.json"}
    assert then == {"pirate": "loaded"}
    assert calls[:2] == [("load", "tuned:pirate", "/a/p"), ("load", "tuned:robot", "/a/broken")]
    assert sorted(calls[2:]) == [("load", "tuned:pirate", "/a/p2"), ("unload", "tuned:robot")]


def test_a_failed_adapter_is_tried_again_with_backoff_and_says_failed_until_it_loads():
    """A hub fetch that timed out stayed failed for the replica's life: a re-apply of the same
    spec is "unchanged", so only a new source or a restart loaded it."""
    from atomr_infer.replica import adapters as adapters_module

    attempts = []

    async def load(name, path):
        attempts.append(path)
        if len(attempts) < 3:
            raise TimeoutError("the Hub did not answer")

    async def main():
        adapters = AdapterSet("tuned", load, lambda name: asyncio.sleep(0), retry_after_s=0.5)
        wanted = {"robot": "org/robot-lora"}
        await asyncio.gather(*adapters.sync(wanted))
        seen = [adapters.states["robot"]]
        assert adapters.sync(wanted) == []  # not before its backoff
        for _ in range(100):
            await asyncio.sleep(0.05)
            await asyncio.gather(*adapters.sync(wanted))  # as health checks call it
            seen.append(adapters.states["robot"])
            if seen[-1] == "loaded":
                break
        return seen

    seen = asyncio.run(main())
    assert len(attempts) == 3 and seen[-1] == "loaded", (attempts, seen)
    assert set(seen[:-1]) == {"failed: the Hub did not answer"}  # never "loading" meanwhile
    assert adapters_module.RETRY_MAX_S >= adapters_module.RETRY_AFTER_S > 0


def test_an_adapter_removed_and_added_back_while_it_loads_is_routed_only_once_vllm_has_it():
    """Its first load, finishing after the removal and the re-add (same source), said ``loaded``;
    the removal's queued unload then dropped it from vLLM while routers still sent it requests."""
    vllm: set[str] = set()  # the names vLLM serves
    gate = asyncio.Event()

    async def load(name, path):
        if not gate.is_set():
            await gate.wait()  # the first, slow load
        await asyncio.sleep(0.01)
        vllm.add(name)

    async def unload(name):
        await asyncio.sleep(0.05)
        vllm.discard(name)

    async def main():
        adapters = AdapterSet("tuned", load, unload)
        adapters.sync({"pirate": "/a/p"})
        await asyncio.sleep(0.01)
        adapters.sync({})  # removed while it loads
        tasks = adapters.sync({"pirate": "/a/p"})  # and added back
        gate.set()
        wrong = []
        for _ in range(20):
            await asyncio.sleep(0.01)
            if "pirate" in adapters.loaded() and "tuned:pirate" not in vllm:
                wrong.append(dict(adapters.states))
        await asyncio.gather(*tasks)
        return wrong, dict(adapters.states)

    wrong, states = asyncio.run(main())
    assert wrong == [] and states == {"pirate": "loaded"}


def test_a_loaded_adapter_given_a_new_source_stays_routable_while_it_reloads():
    """vLLM serves the old weights until the new ones replace them: it went ``loading`` on every
    replica at once, and its requests waited (up to 60 s) for nothing. ``reloading`` is routed to."""
    from types import SimpleNamespace

    from atomr_infer.control.replicas import adapter_routes

    gate = asyncio.Event()

    async def load(name, path):
        if path.endswith("v2"):
            await gate.wait()
        if "broken" in path:
            raise RuntimeError("no adapter_config.json")

    async def main():
        adapters = AdapterSet("tuned", load, lambda name: asyncio.sleep(0))
        await asyncio.gather(*adapters.sync({"pirate": "/a/v1"}))
        reloading = adapters.sync({"pirate": "/a/v2"})
        await asyncio.sleep(0.05)
        during = dict(adapters.states)
        gate.set()
        await asyncio.gather(*reloading)
        after = dict(adapters.states)
        await asyncio.gather(*adapters.sync({"pirate": "/a/broken-v2"}))
        return during, after, dict(adapters.states)

    during, after, broken = asyncio.run(main())
    assert during == {"pirate": "reloading"} and after == {"pirate": "loaded"}
    handle = SimpleNamespace(adapters=lambda: during, adapters_asked=lambda retry=0: {"pirate": "/a/v2"})
    assert adapter_routes(handle, {"pirate": "/a/v2"})[0] == {"pirate"}  # still routed
    assert broken == {"pirate": "failed: no adapter_config.json"}  # the spec's source failed: said so


def test_atomr_status_lists_each_replicas_adapters():
    from atomr_infer.cli.render import adapter_lines

    rows = [{"deployment": "tuned", "replica": "r0", "adapters": {"robot": "loading", "pirate": "loaded"}},
            {"deployment": "tuned", "replica": "r1", "adapters": {}}]
    assert adapter_lines(rows) == ["tuned/r0 adapters: pirate loaded, robot loading"]


def test_an_adapters_requests_go_only_where_it_is_loaded_under_its_full_name():
    from atomr_infer.errors import AdapterNotFound
    from atomr_infer.routing.router import Router
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.wire import HttpHead, HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    class ModelEcho(FakeReplica):
        async def _serve(self, request, put, tokens, resume=None, prefilled=None):
            put(HttpHead(200, JSON))
            put(json.dumps([self.name, json.loads(request.body)["model"]]).encode())

    r0, r1 = ModelEcho("r0"), ModelEcho("r1")
    routes = (ReplicaRoute("r0", "atomr:d:r0", r0, frozenset({"pirate"})), ReplicaRoute("r1", "atomr:d:r1", r1))
    table = RoutingTable(1, {"d": DeploymentRoute("d", 8, "queue", routes, adapters=("pirate", "robot"))})

    async def source(version):
        return table if version != table.version else None

    def request(model):
        data = {"model": model, "prompt": "hi"}
        return RoutingFacts.of("/v1/completions", data), HttpRequest("POST", "/v1/completions", JSON,
                                                                      json.dumps(data).encode())

    async def main():
        router = Router(source, refresh_s=0.0, wait_for_replica_s=0.3)
        served = [json.loads((await answer(router.stream(*request(m))))[1]) for m in ["d:pirate", "pirate"] * 5]
        with pytest.raises(AdapterNotFound, match="deployment 'd' has no adapter 'nope'"):
            await answer(router.stream(*request("d:nope")))
        return served

    served = asyncio.run(main())
    assert {tuple(s) for s in served} == {("r0", "d:pirate")}  # only r0 has it; vLLM gets its full name


def test_the_adapters_slots_count_in_the_memory_check():
    from atomr_infer.control.budget import lora_bytes
    from atomr_infer.models.estimate import lora_slot_bytes

    # SmolLM2-135M's shapes: 30 layers, hidden 576, 3 KV heads of 64, MLP 1536.
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "intermediate_size": 1536}
    per_rank = 2 * 576 + 2 * (576 + 192) + 2 * 576 + 2 * (576 + 1536) + (1536 + 576)  # q, k, v, o, gate, up, down
    assert lora_slot_bytes(config, 8) == 30 * 8 * per_rank * 2
    tuned = spec(adapters={}, max_loras=2, max_lora_rank=8)
    assert lora_bytes(tuned, config, on_cpu=False) == 2 * lora_slot_bytes(config, 8)
    assert lora_bytes(tuned, config, on_cpu=True) == 4 * lora_slot_bytes(config, 8)  # + its host cache


def test_each_adapter_has_a_home_replica_within_the_load_bound():
    from atomr_infer.routing.adapters import pick_adapter_home
    from atomr_infer.routing.table import ReplicaRoute

    replicas = [ReplicaRoute(f"r{i}", f"atomr:d:r{i}", None) for i in range(4)]
    homes = {a: pick_adapter_home(replicas, {}, 8, a)[0].replica_id for a in (f"a{i}" for i in range(16))}
    assert len(set(homes.values())) > 1  # adapters spread over the replicas...
    for adapter, home in homes.items():  # ...each to its own, whichever router asks
        assert pick_adapter_home(list(reversed(replicas)), {}, 8, adapter) == (replicas[int(home[1:])], "adapter_home")
    busy = {f"atomr:d:{homes['a0']}": 6}  # its home far above the mean: the next under the bound
    choice, reason = pick_adapter_home(replicas, busy, 8, "a0")
    assert reason == "adapter_overflow" and choice.replica_id != homes["a0"]
    full = {r.actor_name: 8 for r in replicas}
    assert pick_adapter_home(replicas, full, 8, "a0") == (None, "full")


@pytest.mark.parametrize("affinity", [True, False])
def test_routing_adapter_affinity_false_routes_an_adapter_as_the_base_model(affinity):
    from atomr_infer.routing.router import Router
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    assert Deployment.model_validate({**BASE, "routing": {"adapter_affinity": False}}).routing.adapter_affinity is False
    both = frozenset({"pirate"})
    routes = tuple(ReplicaRoute(f"r{i}", f"atomr:d:r{i}", FakeReplica(f"r{i}"), both) for i in range(2))
    table = RoutingTable(1, {"d": DeploymentRoute("d", 8, "queue", routes, adapters=("pirate",),
                                                  adapter_affinity=affinity)})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source, refresh_s=0.0, wait_for_replica_s=0.3)
        body = json.dumps({"model": "d:pirate", "prompt": "hi"}).encode()
        for _ in range(4):
            await answer(router.stream(RoutingFacts.of("/v1/completions", json.loads(body)),
                                       HttpRequest("POST", "/v1/completions", JSON, body)))
        return dict(router.route_reasons)

    reasons = asyncio.run(main())
    assert reasons == ({("d", "adapter_home"): 4} if affinity else {}), reasons


def test_with_prefix_affinity_an_adapters_conversation_returns_where_it_went_and_starts_at_its_home():
    from atomr_infer.routing.adapters import pick_adapter_home
    from atomr_infer.routing.router import Router
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    loaded = frozenset({"pirate", "robot"})
    routes = tuple(ReplicaRoute(f"r{i}", f"atomr:d:r{i}", FakeReplica(f"r{i}"), loaded) for i in range(4))
    table = RoutingTable(1, {"d": DeploymentRoute("d", 8, "queue", routes, adapters=("pirate", "robot"),
                                                  policy="prefix_affinity")})

    async def source(version):
        return table if version != table.version else None

    document = "Read this document about ships and the sea. " * 40

    async def main():
        router = Router(source, refresh_s=0.0, wait_for_replica_s=0.3)
        served = []
        for model in ("d:pirate", "d:pirate", "d:robot"):
            data = {"model": model, "messages": [{"role": "user", "content": document}]}
            body = json.dumps(data).encode()
            head, text = await answer(router.stream(RoutingFacts.of("/v1/chat/completions", data),
                                                    HttpRequest("POST", "/v1/chat/completions", JSON, body)))
            served.append(text.decode().removeprefix("from "))
        return served, dict(router.route_reasons)

    served, reasons = asyncio.run(main())
    home = {a: pick_adapter_home(list(routes), {}, 8, a)[0].replica_id for a in ("pirate", "robot")}
    # The first at the adapter's home, the second after its prefix; the other adapter's copy of the
    # same prompt is not a hit (vLLM caches per adapter) and goes to its own home.
    assert served == [home["pirate"], home["pirate"], home["robot"]], (served, home)
    assert reasons == {("d", "adapter_home"): 2, ("d", "affinity_hit"): 1}, reasons


def test_a_request_for_an_adapter_still_loading_waits_for_it_past_the_replica_wait():
    """An adapter an apply just added: the router's table may not list it yet (it asks the
    manager again before a 404) and no replica has loaded it (it waits while one loads it,
    however short the wait for a replica is); one every replica failed to load fails at once, saying
    why (it waited out the replica wait, then 503 "no ready replica")."""
    from atomr_infer.errors import AdapterFailed
    from atomr_infer.routing import router as router_module
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    replica = FakeReplica("r0")

    def table(version, adapters=(), loaded=frozenset(), loading=frozenset(), failed=()):
        route = ReplicaRoute("r0", "atomr:d:r0", replica, loaded, loading, failed)
        return RoutingTable(version, {"d": DeploymentRoute("d", 8, "queue", (route,), adapters=adapters)})

    tables = [table(1)]

    async def source(version):
        return tables[-1] if version != tables[-1].version else None

    async def ask(router):
        body = json.dumps({"model": "d:robot", "prompt": "hi"}).encode()
        return await answer(router.stream(RoutingFacts.of("/v1/completions", json.loads(body)),
                                          HttpRequest("POST", "/v1/completions", JSON, body)))

    async def main():
        router = Router(source, refresh_s=60.0, wait_for_replica_s=0.2)
        await router.refresh()  # cached: the table before the apply
        tables.append(table(2, ("robot",), loading=frozenset({"robot"})))  # applied; r0 loading it

        async def loads():
            await asyncio.sleep(0.6)  # three times the replica wait
            tables.append(table(3, ("robot",), loaded=frozenset({"robot"})))

        loader = asyncio.create_task(loads())
        head, text = await ask(router)
        await loader
        await router.aclose()
        tables.append(table(4, ("robot",), failed=(("robot", "OSError: no such file"),)))  # r0 failed to load it
        router = Router(source, refresh_s=60.0, wait_for_replica_s=30.0)
        started = asyncio.get_running_loop().time()
        with pytest.raises(AdapterFailed, match="'robot' of deployment 'd' failed to load on every ready replica: "
                                                "OSError: no such file"):
            await asyncio.wait_for(ask(router), 10.0)  # not after the replica wait (30 s): 503 then
        await router.aclose()
        return head.status, asyncio.get_running_loop().time() - started

    from atomr_infer.routing.router import Router

    status, gave_up_after = asyncio.run(main())
    assert status == 200
    assert gave_up_after < router_module.ADAPTER_LOAD_WAIT_S  # the replica wait, not the adapter's


def test_requests_waiting_for_an_adapter_to_load_are_not_demand():
    """Ten requests for an adapter the one replica was loading (a Hub download: tens of seconds)
    were reported as waiting: past upscale_delay_s the deployment scaled up to more GPU replicas
    (each loading it too) while the one it had was idle. They wait for the load, not for a replica."""
    from atomr_infer.routing.router import Router
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    replica, reports = FakeReplica("r0"), []

    def table(version, **state):
        route = ReplicaRoute("r0", "atomr:d:r0", replica, **state)
        return RoutingTable(version, {"d": DeploymentRoute("d", 16, "queue", (route,), adapters=("robot",))})

    tables = [table(1, adapters_loading=frozenset({"robot"}))]

    async def source(version):
        return tables[-1] if version != tables[-1].version else None

    async def main():
        router = Router(source, refresh_s=0.0, demand=lambda router_id, name, n: reports.append(n))
        body = json.dumps({"model": "d:robot", "prompt": "hi"}).encode()
        asks = [asyncio.create_task(answer(router.stream(RoutingFacts.of("/v1/completions", json.loads(body)),
                                                         HttpRequest("POST", "/v1/completions", JSON, body))))
                for _ in range(10)]
        await asyncio.sleep(0.7)  # past a report's period (0.5 s)
        tables.append(table(2, adapters=frozenset({"robot"})))  # loaded
        answers = await asyncio.wait_for(asyncio.gather(*asks), 5)
        await router.aclose()
        return [head.status for head, _ in answers]

    assert asyncio.run(main()) == [200] * 10
    assert not any(reports), reports


def test_an_adapter_still_loading_past_the_wait_is_named_with_its_deployment_not_as_one(monkeypatch):
    """Every ready replica still loading it after the adapter wait: the 503 said "deployment 'robot'
    has no ready replica" (or 'tuned:robot'), though deployment 'tuned' had two ready."""
    from atomr_infer.errors import AdapterNotLoaded
    from atomr_infer.routing import router as router_module
    from atomr_infer.routing.router import Router
    from atomr_infer.routing.table import ReplicaRoute
    from atomr_infer.serve.errors import http_error
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import JSON, FakeReplica, answer

    monkeypatch.setattr(router_module, "ADAPTER_LOAD_WAIT_S", 0.4)
    routes = tuple(ReplicaRoute(f"r{i}", f"atomr:tuned:r{i}", FakeReplica(f"r{i}"), frozenset(), frozenset({"robot"}))
                   for i in range(2))
    table = RoutingTable(1, {"tuned": DeploymentRoute("tuned", 8, "queue", routes, adapters=("robot",))})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source, refresh_s=60.0, wait_for_replica_s=0.1)
        errors = []
        for model in ("robot", "tuned:robot"):
            body = json.dumps({"model": model, "prompt": "hi"}).encode()
            with pytest.raises(AdapterNotLoaded) as caught:
                await answer(router.stream(RoutingFacts.of("/v1/completions", json.loads(body)),
                                           HttpRequest("POST", "/v1/completions", JSON, body)))
            errors.append(caught.value)
        await router.aclose()
        return errors

    for error in asyncio.run(main()):
        assert str(error).startswith("adapter 'robot' of deployment 'tuned' is not loaded on any of its 2 ready "
                                     "replicas (still loading; waited ")
        http = http_error(error)
        assert http.status == 503 and "Retry-After" in http.headers
        assert str(type(error)(*error.args)) == str(error)  # crosses Ray


def test_an_adapter_reloaded_from_a_new_source_is_not_reloaded_on_every_step():
    """vLLM's serving layer kept the in-place reload's request, load_inplace=True, for every later
    request of the adapter, and its worker re-read the adapter from disk on every step with it."""
    import asyncio
    from collections import defaultdict
    from types import SimpleNamespace

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.utils.counter import AtomicCounter

    from atomr_infer.engine.vllm import adapters as engine_adapters

    models = OpenAIServingModels.__new__(OpenAIServingModels)  # vLLM's own, its engine a recorder
    models.lora_requests, models.lora_id_counter = {}, AtomicCounter(0)
    models.lora_resolver_lock = defaultdict(asyncio.Lock)
    models.registry = SimpleNamespace(is_base_model=lambda name: False)
    sent = []

    async def add_lora(request):
        sent.append(request)
        return True

    models.engine_client = SimpleNamespace(add_lora=add_lora)

    async def main():
        await engine_adapters.load(models, "d:pirate", "/srv/pirate-v1")
        await engine_adapters.load(models, "d:pirate", "/srv/pirate-v2")  # an apply changed its source

    asyncio.run(main())
    assert [(r.lora_path, r.load_inplace) for r in sent] == [("/srv/pirate-v1", False), ("/srv/pirate-v2", True)]
    served = models.lora_requests["d:pirate"]  # what requests for the adapter carry from now on
    assert (served.lora_path, served.load_inplace, served.lora_int_id) == ("/srv/pirate-v2", False, sent[0].lora_int_id)


def test_an_adapter_is_not_said_failed_everywhere_for_replicas_away_for_now_or_an_old_source():
    """A replica excluded for a moment (unreachable) may hold it; a failure of the source an apply
    just replaced is not the new one's: the request waits, it is no 404 "failed to load"."""
    from types import SimpleNamespace

    from atomr_infer.control.replicas import adapter_routes
    from atomr_infer.routing.adapters import failed_everywhere
    from atomr_infer.routing.table import ReplicaRoute

    r0 = ReplicaRoute("r0", "atomr:d:r0", None, frozenset({"pirate"}))
    r1 = ReplicaRoute("r1", "atomr:d:r1", None, adapters_failed=(("pirate", "OSError: gone"),))
    assert failed_everywhere([r0, r1], "pirate", {"atomr:d:r0": 3}) is None  # r0 unreachable for now
    assert failed_everywhere([r0, r1], "pirate", {"atomr:d:r0": None}) == "OSError: gone"  # r0 died
    failed = SimpleNamespace(adapters=lambda: {"pirate": "failed: OSError: gone"},
                             adapters_asked=lambda retry=0: {"pirate": "/a/v1"})
    assert adapter_routes(failed, {"pirate": "/a/v1"})[2] == (("pirate", "OSError: gone"),)
    assert adapter_routes(failed, {"pirate": "/a/v2"})[1:] == (frozenset({"pirate"}), ())  # corrected: loading


def test_a_reloading_adapter_is_listed_and_adapter_failed_crosses_ray():
    import pickle

    from atomr_infer.errors import AdapterFailed
    from atomr_infer.serve.answers import adapter_cards
    from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus

    replica = ReplicaStatus("r0", "atomr:d:r0", ReplicaState.READY, 1, adapters={"pirate": "reloading"})
    status = DeploymentStatus("d", "bundled:smollm2-135m-instruct", 1, 1, 1, 1, (replica,))
    assert [c["id"] for c in adapter_cards(status)] == ["d:pirate"]  # routed to, so listed
    error = pickle.loads(pickle.dumps(AdapterFailed("d", "x", "OSError: gone")))
    assert str(error) == str(AdapterFailed("d", "x", "OSError: gone"))



def test_mid_roll_the_old_replicas_keep_their_adapters_and_the_new_specs_wait_for_the_new_replicas():
    """Turning LoRA on rolls the replicas; the old ones, without LoRA in their engine, were asked to
    load the new adapters, failed them all, and a request for one got a 404 for the whole roll."""
    from atomr_infer.control.managed import ManagedDeployment
    from atomr_infer.control.reconcile import DeploymentReconciler, ReconcileConfig

    from .fakes import FakeClock, FakeLauncher

    clock, launcher = FakeClock(), FakeLauncher()
    reconciler = DeploymentReconciler("tuned", launcher, clock, ReconcileConfig(health_period_s=1.0))
    managed = ManagedDeployment.create(Deployment.model_validate(BASE), reconciler)
    for _ in range(3):
        reconciler.update()
        launcher.make_ready()
        clock.advance(1.0)
    old = launcher.started[0]
    asked = []
    checked = old.poll_health
    old.poll_health = lambda adapters=None, retry=0: asked.append(adapters) or checked(adapters, retry)
    managed.update(spec(adapters={"french": "/srv/french"}), forced_restart=False)
    for _ in range(3):  # the replacement is still starting; the old replica's health is checked meanwhile
        reconciler.update()
        clock.advance(1.0)
    assert len(asked) >= 2 and set(map(repr, asked)) == {"None"}
    [(replica_id, (loaded, pending, failed))] = reconciler._routes()
    assert (replica_id, loaded, pending, failed) == ("r0", frozenset(), frozenset({"french"}), ())  # waits


def test_an_adapter_an_apply_removed_is_neither_listed_nor_routed_while_it_unloads():
    from atomr_infer.control.managed import ManagedDeployment
    from atomr_infer.control.reconcile import DeploymentReconciler, ReconcileConfig

    from .fakes import FakeClock, FakeLauncher

    clock, launcher = FakeClock(), FakeLauncher()
    reconciler = DeploymentReconciler("tuned", launcher, clock, ReconcileConfig(health_period_s=1.0))
    managed = ManagedDeployment.create(spec(adapters={"french": "/srv/fr", "pirate": "/srv/p"}), reconciler)
    for _ in range(3):
        reconciler.update()
        launcher.make_ready()
        clock.advance(1.0)
    assert reconciler.status().replicas[0].adapters == {"french": "loaded", "pirate": "loaded"}
    managed.update(spec(adapters={"french": "/srv/fr"}), forced_restart=False)  # in place, before a health check
    assert reconciler.status().replicas[0].adapters == {"french": "loaded"}
    # The spec's adapters and their sources: /v1/models lists them with none ready, each its root.
    assert reconciler.status().adapter_sources == {"french": "/srv/fr"}
    [(_, (loaded, _pending, _failed))] = reconciler._routes()
    assert loaded == frozenset({"french"})


def test_an_adapter_named_like_a_deployment_or_an_alias_is_refused_whichever_comes_first():
    """A deployment or alias routes before an adapter's bare name: model 'sql' reached deployment
    'sql', not the adapter 'sql' (vllm serve refuses an adapter named like a served model)."""
    from atomr_infer.control.plan import check_names
    from atomr_infer.errors import SpecError

    sql = Deployment.model_validate({"name": "sql", "model": "org/m", "device": "cpu"})
    tuned = spec(adapters={"sql": "/srv/sql"})
    with pytest.raises(SpecError, match=r"lora.adapters.sql: 'sql' already names deployment 'sql'"):
        check_names(tuned, [sql])
    with pytest.raises(SpecError, match=r"name: 'sql' names an adapter of deployment 'tuned'"):
        check_names(sql, [tuned])
    aliased = Deployment.model_validate({**BASE, "serving": {"openai": {"served_model_name": ["chat"]}},
                                         "lora": {"adapters": {"chat": "/srv/chat"}}})
    with pytest.raises(SpecError, match=r"lora.adapters.chat: 'chat' already names deployment 'tuned'"):
        check_names(aliased, [])
    check_names(spec(adapters={"pirate": "/srv/p"}), [sql])  # other names: accepted


def test_an_adapter_a_second_deployment_also_has_is_warned_at_apply_and_named_in_the_404():
    """The bare name of an adapter two deployments have routes to neither: clients of the first,
    which sent 'sql', got "no deployment named 'sql'" without a word at the apply or in the 404."""
    from atomr_infer.errors import DeploymentNotFound
    from atomr_infer.routing.router import Router
    from atomr_infer.wire import HttpRequest, RequestKind, RoutingFacts

    from .test_manager import Harness

    h = Harness()
    first = h.call("apply", {"name": "a", "model": "org/m", "device": "cuda", "lora": {"adapters": {"sql": "/s"}}})
    second = h.call("apply", {"name": "b", "model": "org/m", "device": "cuda",
                              "lora": {"adapters": {"sql": "/s2", "x": "/x"}}})
    assert first.warnings == ()
    assert second.warnings == ("lora.adapters.sql: deployment 'a' has an adapter 'sql' too, so model 'sql' now "
                               "names neither: send 'b:sql' or 'a:sql'",)
    table = RoutingTable(1, {name: DeploymentRoute(name, 8, "queue", (), adapters=("sql",)) for name in ("a", "b")})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source)
        try:
            async for _ in router.stream(RoutingFacts("sql", RequestKind.CHAT), HttpRequest("POST", "/", (), b"{}")):
                pass
        finally:
            await router.aclose()

    with pytest.raises(DeploymentNotFound) as info:
        asyncio.run(main())
    assert str(info.value) == ("no deployment named 'sql' (deployments: a, b; 'sql' is an adapter of a and b: "
                               "send 'a:sql' or 'b:sql')")
    assert str(info.value.unlisted()) == "no deployment named 'sql'"


def test_a_replica_just_ready_is_routed_its_adapters_at_the_next_pass():
    """It loaded them before it said ready, but they were reported by its first health check only,
    a health period later: a one-replica deployment had no replica for them for ~2 s per start."""
    from atomr_infer.control.managed import ManagedDeployment
    from atomr_infer.control.reconcile import DeploymentReconciler, ReconcileConfig

    from .fakes import FakeClock, FakeLauncher

    clock, launcher = FakeClock(), FakeLauncher()
    reconciler = DeploymentReconciler("tuned", launcher, clock, ReconcileConfig(health_period_s=2.0))
    ManagedDeployment.create(spec(adapters={"french": "/srv/fr"}), reconciler)
    reconciler.update()
    launcher.make_ready()
    reconciler.update()  # ready
    clock.advance(0.1)
    reconciler.update()  # the next pass, well within a health period
    [(_, (loaded, _pending, _failed))] = reconciler._routes()
    assert loaded == frozenset({"french"})


def test_atomr_status_says_an_adapter_failed_though_the_deployment_is_ready(monkeypatch):
    """It showed a green 'ready', the failure only in the adapters line; --json had no field for it."""
    from typer.testing import CliRunner

    from atomr_infer.cli import common
    from atomr_infer.cli import status as status_cli
    from atomr_infer.cli.main import app
    from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus

    replica = ReplicaStatus("r0", "atomr:tuned:r0", ReplicaState.READY, 1,
                            adapters={"bad": "failed: LoRA rank 64 is greater than max_lora_rank 16.",
                                      "pirate": "loaded"})
    status = DeploymentStatus("tuned", "m", 1, 1, 1, 1, (replica,))
    monkeypatch.setattr(status_cli, "_statuses", lambda address, name: [status])
    for name, value in (("replica_stats", {}), ("dashboard_url", None), ("node_ips", {}), ("waiting_reasons", {})):
        monkeypatch.setattr(common, name, lambda *args, value=value, **kwargs: value)
    shown = CliRunner().invoke(app, ["status"])
    assert shown.exit_code == 0 and "tuned: adapter 'bad' failed to load: LoRA rank 64" in shown.output, shown.output
    as_json = CliRunner().invoke(app, ["status", "--json"])
    [data] = json.loads(as_json.output)
    assert data["failed_adapters"] == {"bad": "LoRA rank 64 is greater than max_lora_rank 16."}
