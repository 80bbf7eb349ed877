"""The supervisor: the top of the process tree (`moeslab-launch`, `python -m supervisor`, `scripts/launch.py`).

It owns the run directory, the slab's name and unlink, the children (started
by their command lines, `shared.commands`), restarts, liveness, signals and
shutdown. It imports no other process package: it knows each child only by
its command line, its sockets and its exit.
"""
