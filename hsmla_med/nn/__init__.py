"""HSMLA layer, blocks and networks (MONAI-style, 2D and 3D)."""

from hsmla_med.nn import functional
from hsmla_med.nn.attention import BACKENDS, HSMLA, ROUTING_MODES, calibrate_tau
from hsmla_med.nn.dispatch import BackendChoice, select_backend
from hsmla_med.nn.blocks import ChannelLayerNorm, ConvNormAct, DSConv, HSMLABlock, MBConv
from hsmla_med.nn.hsmla_net import VARIANTS, GatedNetwork, HSMLABackbone, HSMLAClassifier, HSMLASegNet, Variant, gate_snapshot

__all__ = [
    "functional",
    "HSMLA",
    "ROUTING_MODES",
    "BACKENDS",
    "calibrate_tau",
    "select_backend",
    "BackendChoice",
    "ChannelLayerNorm",
    "ConvNormAct",
    "DSConv",
    "HSMLABlock",
    "MBConv",
    "VARIANTS",
    "Variant",
    "GatedNetwork",
    "HSMLABackbone",
    "HSMLASegNet",
    "HSMLAClassifier",
    "gate_snapshot",
]
