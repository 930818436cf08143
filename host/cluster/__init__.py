"""pie across machines on Ray: engine replicas as actors, a directory of what is global, and the
front the server talks to in `--ray` mode. Import the modules themselves (they import Ray, an
optional dependency: `pip install pie-serve[cluster]`); `placement` and `directory` need no Ray."""
