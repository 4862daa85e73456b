"""YAML model configs: packaged sizes build the documented networks; bad files fail clearly."""

import pytest

from hsmla_med.config import ConfigError, build_network, load_yaml, model_config
from hsmla_med.nn import VARIANTS


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_packaged_model_configs_build_their_variant(name):
    cfg = model_config(name)
    net = build_network(cfg, 2, 1, 14)
    assert net.variant == name
    layer = next(iter(net.hsmla_layers().values()))
    assert (layer.window, layer.block, layer.scales) == (cfg["attention"]["window"], cfg["attention"]["block"], (3, 5, 7))
    assert build_network(cfg, 3, 2, 2, kind="classification").out_channels == 2


def test_missing_malformed_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("variant: [b0\n")
    with pytest.raises(ConfigError, match="bad.yaml: malformed YAML"):
        load_yaml(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping"):
        load_yaml(listing)


def test_unsafe_yaml_tags_are_refused(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("variant: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="evil.yaml"):
        load_yaml(evil)


def test_unknown_attention_option_and_kind():
    with pytest.raises(ConfigError, match="windw"):
        build_network({"variant": "b0", "attention": {"windw": 7}}, 2, 1, 2)
    with pytest.raises(ConfigError, match="kind"):
        build_network({"variant": "b0"}, 2, 1, 2, kind="detection")
    with pytest.raises(ValueError, match="variant"):
        build_network({"variant": "b7"}, 2, 1, 2)
