"""The release qualification report: build, verdict rule, schema, environment, rendering
and merging across hosts."""
