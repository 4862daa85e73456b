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


def test_decoder_options_build_the_named_network():
    unet = build_network({"variant": "b0", "decoder": "unet", "attention_strides": [8, 16, 32]}, 2, 1, 3)
    assert unet.decoder_kind == "unet" and unet.backbone.attention_strides == (8, 16, 32)
    fpn = build_network({"variant": "b0", "decoder": "fpn", "head_stride": 4}, 2, 1, 3)
    assert fpn.decoder_kind == "fpn" and fpn._first == 1
    with pytest.raises(ConfigError, match="decoder"):
        build_network({"variant": "b0", "decoder": "unet"}, 2, 3, 2, kind="classification")
    with pytest.raises(ConfigError, match="attention_strides"):
        build_network({"variant": "b0", "attention_strides": [2]}, 2, 1, 3)


@pytest.mark.parametrize(
    "config, kind, cls",
    [
        ({"monai": "UNet", "args": {"channels": [8, 16, 32], "strides": [2, 2], "num_res_units": 1}}, "segmentation", "UNet"),
        ({"monai": "SwinUNETR", "args": {"feature_size": 12, "depths": [1, 1, 1, 1]}}, "segmentation", "SwinUNETR"),
        ({"monai": "SegResNet", "args": {"init_filters": 8}}, "segmentation", "SegResNet"),
        ({"monai": "DenseNet121"}, "classification", "DenseNet121"),
    ],
)
def test_monai_networks_get_the_task_dims_and_channels(config, kind, cls):
    import torch
    from monai.networks import nets

    net = build_network(config, 2, 3, 5, kind=kind)
    assert type(net) is getattr(nets, cls)
    out = net(torch.randn(2, 3, 64, 64))
    assert out.shape == ((2, 5, 64, 64) if kind == "segmentation" else (2, 5))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"monai": "NoSuchNet"}, "NoSuchNet.*not a network"),
        ({"monai": "UNet", "args": {"channels": [8, 16], "strides": [2], "bogus": 1}}, "takes no argument.*bogus"),
        ({"monai": "UNet", "args": {"channels": [8, 16], "strides": [2], "out_channels": 3}}, "come from the task"),
        ({"monai": "UNet", "args": [1, 2]}, "model.args must be a mapping"),
        ({"monai": "UNet", "args": {"channels": [8, 16], "strides": [2]}, "variant": "b0"}, "beside 'monai'"),
        ({"monai": "UNet", "args": {"channels": [8], "strides": []}}, "cannot build monai UNet"),
    ],
)
def test_bad_monai_configs_name_the_problem(config, message):
    with pytest.raises(ConfigError, match=message):
        build_network(config, 2, 1, 3)


@pytest.fixture
def registered_family():
    """A user's network family, registered by name for one test (the registry is global)."""
    import torch

    from hsmla_med.nn import registry

    @registry.register_network("tiny-conv")
    def tiny_conv(spatial_dims: int, in_channels: int, out_channels: int, kind: str, width: int = 4) -> torch.nn.Module:
        conv = (torch.nn.Conv2d, torch.nn.Conv3d)[spatial_dims - 2]
        return torch.nn.Sequential(conv(in_channels, width, 3, padding=1), torch.nn.ReLU(), conv(width, out_channels, 1))

    yield tiny_conv
    del registry.NETWORKS["tiny-conv"]


def test_a_registered_family_is_a_model_name_and_a_config(registered_family):
    """A family registered by name is built from ``model: NAME`` or ``{network: NAME, ...}``
    through the one resolution, without a branch in hsmla_med/config.py; an option its builder
    does not take is an error naming it and the ones it takes."""
    import torch

    assert model_config("tiny-conv") == {"network": "tiny-conv"}
    net = build_network(model_config({"network": "tiny-conv", "width": 6}), 2, 1, 3)
    assert net[0].out_channels == 6 and net(torch.randn(1, 1, 8, 8)).shape == (1, 3, 8, 8)
    assert build_network(model_config("tiny-conv"), 3, 2, 5)[0].out_channels == 4  # the builder's default
    with pytest.raises(ConfigError, match=r"the tiny-conv network takes no option\(s\) \['depth'\]; it takes: width"):
        build_network({"network": "tiny-conv", "depth": 2}, 2, 1, 3)
    with pytest.raises(ConfigError, match="'nope' is no registered network family"):
        build_network({"network": "nope"}, 2, 1, 3)
    with pytest.raises(ValueError, match="already registered"):
        from hsmla_med.nn.registry import register_network

        register_network("tiny-conv")(registered_family)


def test_the_default_model_is_named_once():
    """Every packaged task config leaves ``model`` null; the task config names the default, so a
    run's config.yaml says which model it trained."""
    from importlib import resources

    from hsmla_med.config import DEFAULT_MODEL, task_config
    from hsmla_med.pipelines import CARDS

    for name in CARDS:
        assert load_yaml(resources.files("hsmla_med.configs") / f"{name}.yaml")["model"] is None, name
        assert task_config(name)["model"] == DEFAULT_MODEL, name


def test_a_norm_the_network_would_not_get_is_refused():
    """``norm: instance`` with a network that takes no norm (a MONAI network) or names its own was
    silently ignored (batch norm, no warning); now it is an error naming the key. A norm left
    auto, or one the data planned, is not checked."""
    from hsmla_med.config import check_model_settings

    with pytest.raises(ConfigError, match="norm: instance does not reach the network.*takes no norm"):
        check_model_settings({"norm": "instance"}, {"monai": "UNet"})
    with pytest.raises(ConfigError, match="norm: instance does not reach the network.*names its own, norm: batch"):
        check_model_settings({"norm": "instance"}, {"variant": "b0", "norm": "batch"})
    check_model_settings({"norm": "instance"}, {"variant": "b0", "norm": "instance"})
    check_model_settings({"norm": "auto"}, {"monai": "UNet"})
    check_model_settings({"norm": "instance"}, {"monai": "UNet"}, plan={"kept": []})  # planned, not the user's
