"""``python -m ggufswap``."""

from ggufswap.main import main

raise SystemExit(main())
