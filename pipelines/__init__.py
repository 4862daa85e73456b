"""Task pipelines (installed as ``hsmla_med.pipelines``): one module per benchmark, each owning
its on-disk format, transforms, targets, metric set and output format (DESIGN.md §2, §5)."""
