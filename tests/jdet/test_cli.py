"""The CLI: `jdet generate` streams the embedded model's text; bad flags and inputs are named."""

import pytest

from jdet.cli import _generate_config, main
from jdet.settings import EngineConfig


def test_generate_streams_the_prompt_and_its_continuation(capsys):
    rc = main(["generate", "Return a list of", "--max-tokens", "6", "--invariance", "none"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("Return a list of") and len(out.strip()) > len("Return a list of")


def test_generate_loads_each_shape_at_its_first_call_and_compiles_variants_on_demand():
    """`jdet generate` warms nothing up: its config asks the executable cache to serve each step
    shape at its first call (jdet/exec_cache.py), which no other entry point's default does."""
    cfg = _generate_config(EngineConfig(), None)
    assert cfg.exec_cache_on_call and cfg.sampler_variants == "on-demand"
    assert not EngineConfig().exec_cache_on_call
    assert _generate_config(EngineConfig(sampler_variants="full"), None).sampler_variants == "full"


def test_unknown_flag_is_an_error():
    with pytest.raises(SystemExit):
        main(["generate", "x", "--bogus"])


def test_missing_model_directory_is_reported(tmp_path, capsys):
    rc = main(["generate", "x", "--model", str(tmp_path / "nope"), "--invariance", "none"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_value_the_step_cannot_hold_is_named_by_the_cli(capsys):
    """The CLI goes through the same boundary check as the server and LLM (int32 top_k)."""
    rc = main(["generate", "x", "--top-k", str(2**31), "--invariance", "none"])
    assert rc == 2
    assert "top_k must be an integer in [0, 2147483647]" in capsys.readouterr().err


def test_every_engine_and_server_setting_is_a_flag_with_help_and_its_default(capsys):
    """The flags are generated from jdet.settings: one per field, none missing, none drifted."""
    import dataclasses

    from jdet.cli import parser
    from jdet.settings import EngineConfig, ServerConfig, from_args

    for cmd, classes in (("generate", (EngineConfig,)), ("serve", (EngineConfig, ServerConfig))):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        args = parser().parse_args([cmd] + (["x"] if cmd == "generate" else []))
        for cls in classes:
            assert from_args(cls, args) == cls(), cls  # the flags' defaults are the fields'
            for f in dataclasses.fields(cls):
                flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
                assert flag in text, (cmd, flag)


def test_version_flag(capsys):
    from jdet.version import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert __version__ in capsys.readouterr().out
