from kvsidecar.cli import main

raise SystemExit(main())
