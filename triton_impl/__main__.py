from triton_impl.cli import main

raise SystemExit(main())
