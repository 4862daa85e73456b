"""YAML configuration shipped with hsmla-med (installed as ``hsmla_med.configs``)."""
