from commbench.bench.cli import main

# Ranks are spawned: a spawned child re-imports the parent's main module by path, but skips a
# package's __main__ named by its spec. Without the spec, ``python -m commbench`` ranks import
# this file, and with it the CLI's Ctrl-C handling for ranks still starting, as the installed
# ``commbench`` script's ranks do (commbench.bench.cli._quiet_ctrl_c_while_spawning).
__spec__ = None

if __name__ == "__main__":
    raise SystemExit(main())
