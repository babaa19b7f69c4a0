"""Config precedence, validation and byte sizes."""

from pathlib import Path

import pytest

from cachecraft.config import Config, ConfigError, parse_bytes
from cachecraft.policy.planner import PolicyParams


def test_precedence_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "from-file"\nmax_new_tokens = 7\ncacheblend_ratio = 0.3\n')
    env = {"CACHECRAFT_MAX_NEW_TOKENS": "9", "CACHECRAFT_CACHE_DIR": str(tmp_path / "cd")}
    config = Config.load(path, overrides={"cacheblend_ratio": 0.5, "model": None}, environ=env)
    assert config.model == "from-file"
    assert config.max_new_tokens == 9
    assert config.cacheblend_ratio == 0.5
    assert config.cache_dir == tmp_path / "cd"
    assert config.models_dir == tmp_path / "cd" / "models"


def test_config_path_from_environment_and_table_form(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[cachecraft]\ncpu_budget_bytes = "1MiB"\n')
    config = Config.load(environ={"CACHECRAFT_CONFIG": str(path)})
    assert config.cpu_budget_bytes == 2**20


def test_unknown_keys_list_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['modle'\].*known keys.*'model'"):
        Config.from_mapping({"modle": "x"})


@pytest.mark.parametrize("key,value", [("device", "tpu"), ("cacheblend_ratio", 1.5), ("max_new_tokens", 0),
                                       ("cpu_budget_bytes", 0), ("disk_budget_bytes", "-5MB"),
                                       ("check_layer", "one"), ("eviction", "random"), ("chunk_tokens", 8),
                                       ("chunk_overlap", 200), ("top_k", 0), ("embedder", " "),
                                       ("stream_kv", "sometimes"), ("retrieval_order", "random")])
def test_bad_values_are_rejected_with_the_key_named(key, value):
    with pytest.raises(ConfigError, match=key.split("_")[0]):
        Config.from_mapping({key: value})


def test_corrupted_or_missing_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"model = \xff\xfe [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "nope.toml", environ={})


def test_a_config_path_that_is_a_directory_or_keys_beside_the_table_are_refused(tmp_path, caplog):
    with pytest.raises(ConfigError, match="is a directory; give a TOML file"):
        Config.load(tmp_path, environ={})
    mixed = tmp_path / "mixed.toml"
    mixed.write_text("top_k = 5\n[cachecraft]\nchunk_overlap = 2\n")  # top_k would be ignored
    with pytest.raises(ConfigError, match=r"settings outside its \[cachecraft\] table \(top_k\)"):
        Config.load(mixed, environ={})
    shared = tmp_path / "shared.toml"
    shared.write_text("[cachecraft]\ntop_k = 5\n[other_tool]\nx = 1\n")
    assert Config.load(shared, environ={}).top_k == 5
    assert "only the [cachecraft] table is read; ignoring [other_tool]" in caplog.text


@pytest.mark.parametrize("key,value", [("server_timeout_s", "inf"), ("policy_alpha", float("nan")),
                                       ("cacheblend_ratio", "-inf")])
def test_a_setting_that_is_not_a_finite_number_is_refused(key, value):
    with pytest.raises(ConfigError, match=f"{key}: .* is not a finite number"):
        Config.from_mapping({key: value})


def test_an_empty_cache_dir_is_refused_not_taken_for_the_current_directory():
    with pytest.raises(ConfigError, match="cache_dir: an empty path names nothing"):
        Config.load(environ={"CACHECRAFT_CACHE_DIR": ""})


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(123) == 123
    assert parse_bytes("1.5KiB") == 1536
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_to_dict_is_json_friendly(tmp_path):
    values = Config.load(overrides={"cache_dir": tmp_path}, environ={}).to_dict()
    assert values["cache_dir"] == str(tmp_path)
    assert isinstance(Path(values["cache_dir"]), Path)


def test_config_toml_in_the_cache_dir_is_read_when_no_file_is_given(tmp_path):
    cache = tmp_path / "cd"
    cache.mkdir()
    (cache / "config.toml").write_text("policy_alpha = 0.07\nmax_new_tokens = 5\n")
    env = {"CACHECRAFT_CACHE_DIR": str(cache), "CACHECRAFT_MAX_NEW_TOKENS": "6"}
    config = Config.load(environ=env)
    assert config.policy_alpha == 0.07 and config.max_new_tokens == 6  # the environment still wins
    assert Config.load(overrides={"cache_dir": cache}, environ={}).policy_alpha == 0.07
    explicit = tmp_path / "other.toml"
    explicit.write_text("max_new_tokens = 3\n")
    chosen = Config.load(explicit, environ=env)
    assert chosen.policy_alpha == PolicyParams().alpha and chosen.max_new_tokens == 6  # an explicit file replaces it
    assert Config.load(overrides={"cache_dir": tmp_path / "empty"}, environ={}).policy_alpha == PolicyParams().alpha


def test_retrieval_settings_have_defaults_and_env_overrides(tmp_path):
    config = Config.load(environ={"CACHECRAFT_CACHE_DIR": str(tmp_path), "CACHECRAFT_TOP_K": "5",
                                  "CACHECRAFT_CHUNK_TOKENS": "128", "CACHECRAFT_RETRIEVAL_ORDER": "document"})
    assert (config.embedder, config.chunk_tokens, config.chunk_overlap, config.top_k) == ("minilm", 128, 0, 5)
    assert config.retrieval_order == "document" and Config().retrieval_order == "score"
    assert config.corpus_dir == tmp_path / "corpus"


def test_warm_context_takes_builtin_none_or_an_existing_file(tmp_path):
    from cachecraft.warm_context import BUILTIN_TEXT, load_text

    assert Config.load(overrides={"cache_dir": tmp_path}, environ={}).warm_context == "builtin"
    text = tmp_path / "context.txt"
    text.write_text("Some ordinary prose.\n")
    config = Config.load(overrides={"cache_dir": tmp_path, "warm_context": str(text)}, environ={})
    assert load_text(config.warm_context) == "Some ordinary prose.\n"
    assert load_text("builtin") == BUILTIN_TEXT and load_text("none") == ""
    with pytest.raises(ConfigError, match="warm_context must be"):
        Config.load(overrides={"cache_dir": tmp_path, "warm_context": str(tmp_path / "missing.txt")}, environ={})
    binary = tmp_path / "context.bin"
    binary.write_bytes(b"plain start \xb8\xff")
    with pytest.raises(ConfigError, match=r"warm_context .*context.bin is not UTF-8 text \(invalid start byte at byte 12\)"):
        load_text(str(binary))


def test_a_result_command_carries_the_settings_that_differ_from_the_defaults(tmp_path):
    import shlex

    from cachecraft.bench.common import with_settings

    config = Config.load(overrides={"cache_dir": tmp_path, "policy_alpha": 0.2, "system_prompt": "Be brief."},
                         environ={"CACHECRAFT_WARM_CONTEXT": "none"})
    assert config.settings_changed() == {"system_prompt": "Be brief.", "policy_alpha": 0.2, "warm_context": "none"}
    line = with_settings("cachecraft bench scaling --repeats 2", config)
    assert line == ("CACHECRAFT_SYSTEM_PROMPT='Be brief.' CACHECRAFT_POLICY_ALPHA=0.2 CACHECRAFT_WARM_CONTEXT=none "
                    "cachecraft bench scaling --repeats 2")
    environ = dict(word.split("=", 1) for word in shlex.split(line) if word.startswith("CACHECRAFT_"))
    assert Config.load(environ=environ).settings_changed() == config.settings_changed()  # the line reproduces it
    assert Config.load(overrides={"cache_dir": tmp_path}, environ={}).settings_changed() == {}
    # a default given explicitly is carried too: it overrides a model's calibrated fit
    given = Config.load(overrides={"cache_dir": tmp_path}, environ={"CACHECRAFT_POLICY_SINK_TOKENS": "0"})
    assert given.settings_changed() == {"policy_sink_tokens": 0} and given.given == {"cache_dir", "policy_sink_tokens"}
    assert with_settings("cachecraft bench quality", given) == "CACHECRAFT_POLICY_SINK_TOKENS=0 cachecraft bench quality"
    assert given.replace(policy_floor=0.0).given == {"cache_dir", "policy_sink_tokens", "policy_floor"}
    assert Config().given == frozenset()


def test_stream_kv_reads_booleans_from_toml_and_words_from_the_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("stream_kv = false\n")
    assert Config().stream_kv is True
    assert Config.load(path, environ={}).stream_kv is False
    for word, value in [("0", False), ("No", False), ("off", False), ("TRUE", True), ("yes", True)]:
        assert Config.load(environ={"CACHECRAFT_STREAM_KV": word}).stream_kv is value
    off = Config.load(environ={"CACHECRAFT_STREAM_KV": "false"})
    assert off.settings_changed() == {"stream_kv": False}
    from cachecraft.bench.common import with_settings

    assert with_settings("cachecraft bench scaling", off) == "CACHECRAFT_STREAM_KV=false cachecraft bench scaling"


def test_an_unknown_environment_variable_is_named_with_the_nearest_key(tmp_path, caplog):
    env = {"CACHECRAFT_TOPK": "5", "CACHECRAFT_CACHE_DIR": str(tmp_path), "CACHECRAFT_CONFIG_X_UNLIKE": "1",
           "CACHECRAFT_MAX_NEW_TOKENS": "9"}
    with caplog.at_level("WARNING", logger="cachecraft.config"):
        config = Config.load(environ=env)
        Config.load(environ=env)  # said once per process
    assert config.top_k == 3 and config.max_new_tokens == 9
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    topk = next(m for m in messages if "CACHECRAFT_TOPK" in m)
    assert "did you mean CACHECRAFT_TOP_K" in topk and "\n" not in topk
    assert all("CACHECRAFT_CACHE_DIR" not in m and "MAX_NEW_TOKENS" not in m for m in messages)
    with caplog.at_level("WARNING", logger="cachecraft.config"):
        Config.load(path=None, environ={"CACHECRAFT_CACHE_DIR": str(tmp_path), "CACHECRAFT_CONFIG": ""})
    assert len(caplog.records) == 2  # CACHECRAFT_CONFIG is known
