from sglang_dspark.evaluation.runner import main

raise SystemExit(main())
