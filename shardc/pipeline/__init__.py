"""Pipeline parallelism: a scan over layers split into stages over one mesh axis."""
