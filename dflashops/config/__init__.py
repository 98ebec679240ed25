"""User-facing configuration: inventory and playbook models and their YAML loading."""
