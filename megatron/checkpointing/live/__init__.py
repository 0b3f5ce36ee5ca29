"""What every save and load of a running job goes through: our --save directory's protocol (directory.py), the
commit and its markers, atomic writes, integrity manifests and verification, safe loading, disk space, --async-save."""
