"""``python -m pagedkv`` is the ``pagedkv`` command."""

from pagedkv.cli import main

raise SystemExit(main())
