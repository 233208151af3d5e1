"""The distributed debugger (Monarch's `monarch debug`): `breakpoint()` in an actor pauses it
in pdb (`breakpoint`), served on a loopback socket (`wire`) and listed in this user's runtime
directory (`paused`); `client` lists, attaches and casts; `ranks` parses `ranks(...)`."""
