"""Performance model: compiled program -> execution graph -> costs -> timeline (see README.md)."""
