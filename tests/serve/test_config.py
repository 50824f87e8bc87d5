"""serve_config.yaml and the load-model body: our fields and Bodega's, refusals that name the field, safe paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.config import MAX_MODEL_ID_CHARS, ModelConfig, model_id_of_app, serve_app_name
from deployments.ingress_config import IngressConfig
from deployments.model_sources import check_admin_model, check_model_folder, check_model_sources, default_model_roots
from deployments.ingress.model_store import ModelStore
from engine.errors import InvalidRequestError
from engine.spec_decode.config import SpeculativeConfig

REPO = Path(__file__).resolve().parents[2]


def test_serve_config_yaml_validates_and_names_apps_by_model_id():
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    ingress, *models = config["applications"]
    assert ingress["route_prefix"] == "/"
    IngressConfig.model_validate(ingress["args"])
    assert models, "the default model is preconfigured"
    for app in models:
        model = ModelConfig.model_validate(app["args"])
        assert app["name"] == serve_app_name(model.id) and app["route_prefix"] is None
        model.engine_config()
    assert ModelConfig.model_validate(models[0]["args"]).uses_default_model
    embedder = ModelConfig.model_validate(models[1]["args"])
    assert embedder.uses_default_embedding_model and embedder.model_type == "embedding"


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(ValidationError, match="cb_max_num_seq\\b"):
        ModelConfig.model_validate({"model_path": "default", "cb_max_num_seq": 4})
    with pytest.raises(ValidationError, match="engine_process"):  # always on now: no longer a field
        ModelConfig.model_validate({"model_path": "default", "engine_process": False})
    with pytest.raises(ValidationError, match="stream_channel"):  # an internal knob: under `advanced:` only
        ModelConfig.model_validate({"model_path": "default", "stream_channel": False})
    with pytest.raises(ValidationError, match="num_gpu\\b"):
        ModelConfig.model_validate({"model_path": "default", "ray_actor_options": {"num_gpu": 1}})
    with pytest.raises(ValidationError, match="statedir"):
        IngressConfig.model_validate({"statedir": "/tmp"})


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "embedding"}, "'default' is a chat model"),
        ({"model_path": "default-embedding", "model_type": "lm"}, "model_type must be 'embedding'"),
        ({"model_type": "diffusion"}, "model_type"),
        ({"tool_call_parser": "qwen9"}, "unknown parser"),
        ({"reasoning_parser": "nope"}, "unknown parser"),
        ({"cb_max_num_seqs": 0}, "max_num_seqs"),
        ({"cb_max_num_seqs": 4, "max_num_seqs": 8}, "name the same setting"),
        ({"prompt_cache_size": -1}, "'prompt_cache_size' must be an integer >= 0"),
        ({"prompt_cache_size": 10, "cb_enable_prefix_cache": False}, "asks for prompt caching"),
        # Bodega's fields with no meaning here yet: refused naming the field and why, never silently ignored.
        ({"lora_scales": [1.0]}, "'lora_scales' has 1 entries for 0 lora_paths"),
        ({"lora_paths": ["/a", "/b"], "lora_scales": [1.0]}, "'lora_scales' has 1 entries for 2 lora_paths"),
        ({"adapters": {"a:b": "/a"}}, "adapter name 'a:b'"),
        ({"model_path": "default-embedding", "adapters": {"a": "/a"}}, "apply to model_type 'lm'"),
        ({"config_name": "solomon"}, "'config_name' names an image model's family, not a model_type 'lm' one"),
        ({"model_type": "image-generation", "config_name": "solomon"}, "model_type image-generation with "
         "config_name 'solomon': this server runs flux2-klein-4b, flux2-klein-9b"),
        ({"model_type": "image-edit"}, "model_type image-edit with no config_name: this server runs "
         "flux2-klein-edit-4b, flux2-klein-edit-9b"),
        ({"model_type": "image-generation", "config_name": "flux2-klein-4b", "quantize": "auto"},
         "an image model's 'quantize' is 4, 8 or 16 bits"),
        ({"model_type": "image-generation", "config_name": "flux2-klein-4b", "adapters": {"a": "/a"}},
         "per-request adapters apply to model_type 'lm'"),
        ({"disable_auto_resize": True}, "'disable_auto_resize: true' is not served"),
        ({"continuous_batching": False, "cb_prefill_batch_size": 8}, "'cb_prefill_batch_size' cannot be set with "
         "continuous_batching: false"),  # named as the body sent it
        ({"continuous_batching": False, "max_decode_seqs": 8}, "'max_decode_seqs' cannot be set with"),
        ({"disable_auto_resize": "no"}, "'disable_auto_resize' must be true or false"),
        ({"enable_auto_tool_choice": 1}, "'enable_auto_tool_choice' must be true or false"),
        ({"draft_model_path": "/m/draft", "speculative": {"method": "ngram"}},
         "'draft_model_path' and 'speculative' both configure speculative decoding: give one"),
        ({"num_draft_tokens": 2, "speculative": {}}, "'num_draft_tokens' and 'speculative' both configure"),
        ({"num_draft_tokens": 0}, "speculative.num_draft_tokens\n.*greater than or equal to 1"),
        ({"num_draft_tokens": 17}, "speculative.num_draft_tokens\n.*less than or equal to 16"),
        ({"speculative": {"method": "mtp"}}, "speculative.method\n.*'ngram' or 'draft'"),
        ({"speculative": {"method": "draft"}}, "method 'draft' needs 'speculative.draft_model_path'"),
        ({"speculative": {"method": "ngram", "draft_model_path": "/m/d"}}, "is for method 'draft', not 'ngram'"),
        ({"speculative": {"min_match": 5, "max_match": 3}}, "'speculative.min_match' \\(5\\) must be <= "),
        ({"speculative": {"max_verify_tokens": 1}}, "speculative.max_verify_tokens\n.*greater than or equal to 2"),
        ({"speculative": {"num_draft": 2}}, "speculative.num_draft\n.*Extra inputs"),
        ({"speculative": {"num_draft_tokens": "4"}}, "speculative.num_draft_tokens\n"),
        ({"speculative": {"adaptive": "no"}}, "speculative.adaptive\n.*valid boolean"),
        ({"model_path": "default-embedding", "speculative": {}}, "applies to model_type 'lm', not 'embedding'"),
        ({"model_type": "multimodal", "draft_model_path": "/m/d"}, "applies to model_type 'lm', not 'multimodal'"),
        ({"continuous_batching": False, "max_decode_seqs": 4}, "use max_concurrency"),
        ({"prefix_cache_bytes": 10}, "at least 1048576"),
        ({"queue_timeout": 0}, "queue_timeout"),
        ({"model_id": "a--b"}, "must not contain '--'"),
        ({"model_id": "../etc"}, "may hold only"),
        ({"model_id": "has space"}, "may hold only"),
        ({"model_id": "m" * 129}, "model_id is 129 characters long; the most is 128"),
        ({"model_id": "a//b"}, "empty part"),
        ({"model_id": "org/"}, "empty part"),
        ({"num_replicas": 2, "autoscaling": {}}, "'autoscaling' bounds them: set one"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas is over max_replicas"),
        ({"autoscaling": {"target_ongoing_requests": 0}}, "greater than 0"),
    ],
)
def test_invalid_values_are_refused_with_a_reason(fields, message):
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate({"model_path": "default", **fields})


def test_bodega_names_and_sequential_mode_map_to_our_fields():
    bodega = ModelConfig.model_validate({
        "model_path": "default", "cb_max_num_seqs": 64, "cb_prefill_batch_size": 4, "cb_completion_batch_size": 16,
        "cb_chunked_prefill_tokens": 512, "cb_enable_prefix_cache": False, "queue_timeout": 30.0,
    })
    ours = ModelConfig.model_validate({
        "model_path": "default", "max_num_seqs": 64, "max_prefill_seqs": 4, "max_decode_seqs": 16,
        "prefill_chunk_tokens": 512, "enable_prefix_cache": False, "queue_timeout": 30.0,
    })
    assert bodega == ours
    engine = bodega.engine_config()
    assert (engine.max_num_seqs, engine.max_prefill_seqs, engine.max_decode_seqs) == (64, 4, 16)
    assert (engine.prefill_chunk_tokens, engine.enable_prefix_cache, engine.queue_timeout) == (512, False, 30.0)
    sequential = ModelConfig.model_validate({"model_path": "default", "continuous_batching": False, "max_concurrency": 2})
    assert (sequential.max_prefill_seqs, sequential.max_decode_seqs) == (2, 2)
    assert ModelConfig.model_validate({"model_path": "default", "continuous_batching": True, "max_concurrency": 5}) \
        == ModelConfig(model_path="default")  # max_concurrency only applies in sequential mode
    # Bodega's docs load with "max_concurrency": 1 and no continuous_batching: its default, sequential mode.
    documented = ModelConfig.model_validate({"model_path": "default", "max_concurrency": 1})
    assert (documented.max_prefill_seqs, documented.max_decode_seqs) == (1, 1)


def test_speculative_decoding_from_our_field_and_bodegas():
    """Bodega's draft_model_path (+ num_draft_tokens) is a draft model; num_draft_tokens alone is n-gram lookup."""
    def engine(fields: dict) -> SpeculativeConfig | None:
        return ModelConfig.model_validate({"model_path": "default", **fields}).engine_config().speculative

    assert engine({}) is None and engine({"speculative": None}) is None
    assert engine({"draft_model_path": None, "num_draft_tokens": None}) is None  # null: not given
    assert engine({"draft_model_path": "/m/draft"}) == SpeculativeConfig("draft", 4, draft_model_path="/m/draft")
    assert engine({"draft_model_path": "/m/draft", "num_draft_tokens": 6}) == SpeculativeConfig(
        "draft", 6, draft_model_path="/m/draft")
    assert engine({"num_draft_tokens": 3}) == SpeculativeConfig("ngram", 3)
    assert engine({"speculative": {}}) == SpeculativeConfig("ngram", 4, 2, 4)
    assert engine({"speculative": {"adaptive": False}}) == SpeculativeConfig("ngram", 4, 2, 4, adaptive=False)
    assert engine({"speculative": {"draft_model_path": "/m/d"}}).method == "draft"  # method follows the path
    ours = {"method": "ngram", "num_draft_tokens": 8, "min_match": 1, "max_match": 6, "max_verify_tokens": 64}
    assert engine({"speculative": ours}) == SpeculativeConfig("ngram", 8, 1, 6, max_verify_tokens=64)
    bodega = ModelConfig.model_validate({"model_path": "default", "draft_model_path": "/m/d", "num_draft_tokens": 2})
    assert bodega == ModelConfig.model_validate(
        {"model_path": "default", "speculative": {"method": "draft", "draft_model_path": "/m/d", "num_draft_tokens": 2}})


def test_draft_model_paths_are_checked_like_model_paths(tiny_models, tmp_path):
    """serve_config.yaml: any folder (relative to where serve ran) holding config.json; an admin load: under
    model_roots only, refused the same way whether the folder exists or not."""
    def with_draft(draft: str) -> ModelConfig:  # auto_download false: an uncached draft repo is refused, not fetched
        return ModelConfig(model_id="m", model_path=str(tiny_models.alpha), speculative={"draft_model_path": draft},
                           auto_download=False)

    resolved = check_model_sources(with_draft("beta"), base_dir=tiny_models.beta.parent)
    assert resolved.speculative.draft_model_path == str(tiny_models.beta.resolve())
    assert resolved.engine_config().speculative.draft_model_path == str(tiny_models.beta.resolve())
    for draft, message in [(f"{tiny_models.beta}/../beta", "must not contain '..'"), (str(tmp_path), "no config.json"),
                           ("relative/folder/x", "absolute"), ("org/not-cached", "not in the local Hugging Face cache")]:
        with pytest.raises(InvalidRequestError, match=message) as refused:
            check_model_sources(with_draft(draft))
        assert refused.value.param == "speculative.draft_model_path"
    roots = [str(tiny_models.alpha)]
    for draft in (str(tiny_models.beta), "/no/such/folder", "/etc"):
        with pytest.raises(InvalidRequestError) as refused:
            check_admin_model(with_draft(draft), roots)
        assert (refused.value.param, refused.value.message) == (
            "speculative.draft_model_path", "'speculative.draft_model_path' lies outside the allowed model_roots")
    with pytest.raises(InvalidRequestError, match="absolute path to a model folder or a Hugging Face repo id"):
        check_admin_model(with_draft("./beta"), roots)
    allowed = check_admin_model(with_draft(str(tiny_models.beta)), [str(tiny_models.alpha), str(tiny_models.beta)])
    assert allowed.speculative.draft_model_path == str(tiny_models.beta.resolve())


def test_advanced_knobs_reach_the_engine_config():
    config = ModelConfig.model_validate(
        {"model_path": "default", "advanced": {"pad_prefill_shapes": False, "prefill_warmup_seconds": 15}}
    )
    engine = config.engine_config()
    assert (engine.pad_prefill_shapes, engine.prefill_warmup_seconds) == (False, 15)
    default = ModelConfig(model_path="default").engine_config()
    assert (default.pad_prefill_shapes, default.prefill_warmup_seconds) == (None, 120.0)
    with pytest.raises(ValidationError, match="greater than or equal"):
        ModelConfig.model_validate({"model_path": "default", "advanced": {"prefill_warmup_seconds": -1}})
    with pytest.raises(ValidationError, match="bogus"):
        ModelConfig.model_validate({"model_path": "default", "advanced": {"bogus": 1}})


def test_model_ids_map_to_serve_application_names():
    assert serve_app_name("org/model") == "org--model" and model_id_of_app("org--model") == "org/model"
    assert ModelConfig(model_path="default").id == "SmolLM2-135M-Instruct"
    assert ModelConfig(model_path="/models/qwen3-0.6b").id == "qwen3-0.6b"  # Bodega defaults the id to the path


def test_model_folders_are_checked_safely(tiny_models, tmp_path):
    folder = tiny_models.alpha
    assert check_model_folder(str(folder)) == folder.resolve()
    cases = [
        (f"{folder}/../alpha", "'..'"),
        ("relative/folder", "absolute"),
        (str(folder / "config.json"), "not a directory"),
        (str(tmp_path), "no config.json"),
    ]
    for raw, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as refused:
            check_model_folder(raw)
        assert refused.value.param == "model_path"
    with pytest.raises(InvalidRequestError, match="model_roots"):
        check_model_folder(str(folder), roots=[str(tmp_path)])
    assert check_model_folder("alpha", base_dir=folder.parent) == folder.resolve()


def test_model_ids_are_short_enough_for_serve_log_file_names():
    """Serve names a replica's log file after its application; a file name holds 255 bytes (Linux)."""
    from ray.serve._private.common import ServeComponentType
    from ray.serve._private.utils import get_component_file_name

    longest = ModelConfig(model_path="default", model_id="a/" * (MAX_MODEL_ID_CHARS // 2 - 1) + "ab").id
    assert len(longest) == MAX_MODEL_ID_CHARS
    names = [
        get_component_file_name(f"{serve_app_name(longest)}_ModelServer", "abcd1234", ServeComponentType.REPLICA, suffix)
        for suffix in (".log", "_memray_10.bin", "_tracing.json")
    ]
    assert max(len(name) for name in names) + len(".99") <= 255, names  # rotated logs: .log.N
    with pytest.raises(ValidationError, match="the most is 128"):  # an id taken from a folder's name too
        ModelConfig(model_path="/m/" + "n" * 129)


def test_default_model_roots_are_orchards_and_hugging_faces_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "orchard"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert default_model_roots() == [str(tmp_path / "orchard" / "models"), str(tmp_path / "hub")]
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_model_roots()[1] == str(tmp_path / "hf" / "hub")
    assert IngressConfig().model_roots is None  # unset: the registry takes these defaults


def test_admin_loads_refuse_paths_outside_the_roots_without_looking_at_them(tiny_models, tmp_path):
    roots = [str(tmp_path)]
    answers = []
    for path in (tiny_models.alpha, tiny_models.alpha / "config.json", "/no/such/folder", "/etc"):
        with pytest.raises(InvalidRequestError) as refused:
            check_admin_model(ModelConfig(model_id="m", model_path=str(path)), roots)
        answers.append((refused.value.param, refused.value.message))
    assert set(answers) == {("model_path", "'model_path' lies outside the allowed model_roots")}
    allowed = check_admin_model(ModelConfig(model_id="m", model_path=str(tiny_models.alpha)), [str(tiny_models.alpha)])
    assert allowed.model_path == str(tiny_models.alpha.resolve())
    assert check_admin_model(ModelConfig(model_path="default"), []).uses_default_model


def test_every_path_in_a_model_config_is_checked(tiny_models, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    config = ModelConfig(model_path=str(tiny_models.alpha), chat_template_file=str(template))
    assert check_model_sources(config).chat_template_file == str(template.resolve())
    with pytest.raises(InvalidRequestError) as refused:
        check_model_sources(ModelConfig(model_path=str(tiny_models.alpha), chat_template_file="../t.jinja"))
    assert refused.value.param == "chat_template_file"


def test_model_store_round_trip_and_bad_entries(tmp_path):
    store = ModelStore(tmp_path / "state")
    assert store.load() == []
    configs = [ModelConfig(model_path="default"), ModelConfig(model_path="/m/x", model_id="org/x", max_num_seqs=3)]
    store.save(configs)
    assert store.load() == configs
    store.path.write_text('{"models": [{"model_path": "/m/y"}, {"model_path": "/m/z", "bogus": 1}]}')
    assert [c.id for c in store.load()] == ["y"]  # the bad entry is skipped, not the whole list
    store.path.write_text("{not json")
    assert store.load() == []


@pytest.mark.parametrize("interval_ms, expected_s", [(0.25, 0.00025), (None, 0.003)])
def test_model_process_gil_switch_interval(tiny_models, interval_ms, expected_s):
    """The model's process takes the configured switch interval at start; null leaves Python's setting."""
    import asyncio
    import sys

    from deployments.model.service import ModelService, thread_engine_client

    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.003)
    config = ModelConfig(model_path=str(tiny_models.alpha), advanced={"gil_switch_interval_ms": interval_ms})
    service = ModelService(config, thread_engine_client)

    async def start_and_stop() -> float:
        await service.start()
        try:
            return sys.getswitchinterval()
        finally:
            await service.shutdown()

    try:
        assert asyncio.run(start_and_stop()) == pytest.approx(expected_s)
    finally:
        sys.setswitchinterval(previous)
    assert ModelConfig(model_path="x").advanced.gil_switch_interval_ms == 0.5


def test_bodega_prompt_cache_size_is_accepted_as_the_prefix_cache():
    # Bodega's docs load a model with "prompt_cache_size": 25 (its default 0): recurring prompts come from cache,
    # which Orchard's block prefix cache does on its own.
    for size in (0, 25):
        assert ModelConfig.model_validate({"model_path": "default", "prompt_cache_size": size}) == \
            ModelConfig(model_path="default")


def test_bodega_switches_that_change_nothing_here_are_accepted():
    """enable_auto_tool_choice (tools are parsed whenever a request sends them) and disable_auto_resize: false (the
    processor's resizing, Bodega's default) change nothing: the config equals one without them."""
    plain = ModelConfig.model_validate({"model_path": "default"})
    for extra in ({"enable_auto_tool_choice": True}, {"enable_auto_tool_choice": False},
                  {"disable_auto_resize": False}, {"lora_paths": None, "config_name": None}):
        assert ModelConfig.model_validate({"model_path": "default", **extra}) == plain, extra


def test_vision_warmup_sizes_are_checked_and_default_to_none_on_the_cpu():
    from deployments.model.vision_warmup import vision_warmup_sizes

    assert vision_warmup_sizes(ModelConfig(model_path="default")) == ()  # this machine's MLX runs on the CPU
    assert vision_warmup_sizes(ModelConfig(model_path="default", vision_warmup_sizes=["672x672"])) == ("672x672",)
    for bad in (["672"], ["0x10"], ["10x10x3"], ["12345x2"]):
        with pytest.raises(ValueError, match="is not a size WxH"):
            ModelConfig(model_path="default", vision_warmup_sizes=bad)


def test_replicas_fixed_or_autoscaled_reach_serve():
    fixed = ModelConfig(model_path="default", num_replicas=2)
    assert fixed.deployment_options()["num_replicas"] == 2 and "autoscaling_config" not in fixed.deployment_options()
    assert not fixed.single_replica and ModelConfig(model_path="default").single_replica
    scaled = ModelConfig(model_path="default", autoscaling={"min_replicas": 1, "max_replicas": 3})
    options = scaled.deployment_options()
    assert "num_replicas" not in options and options["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 32.0, "upscale_delay_s": 10.0,
        "downscale_delay_s": 300.0}
    assert scaled.max_replicas == 3 and not scaled.single_replica
    from ray.serve.config import AutoscalingConfig  # Serve takes it as it is

    assert AutoscalingConfig(**options["autoscaling_config"]).max_replicas == 3
