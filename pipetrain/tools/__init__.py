"""The command line and what it drives: the ``pipetrain`` verbs, ``pipetrain train``'s task and
the bridge from plan files to pipelines."""
