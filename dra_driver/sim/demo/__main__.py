"""``python -m dra_driver.sim.demo`` (``make demo``) runs the demo."""

from dra_driver.sim.demo.nodeflow import main

raise SystemExit(main())
