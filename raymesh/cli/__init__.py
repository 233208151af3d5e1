"""The `raymesh` command line."""
