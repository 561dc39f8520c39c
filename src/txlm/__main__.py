from txlm.cli import main

raise SystemExit(main())
