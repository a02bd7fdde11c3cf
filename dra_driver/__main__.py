"""``python -m dra_driver`` runs the node agent (same as ``gpu-dra-kubelet-plugin``)."""

from dra_driver.cli import main

raise SystemExit(main())
