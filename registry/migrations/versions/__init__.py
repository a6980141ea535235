"""Registry schema revisions, oldest first."""
