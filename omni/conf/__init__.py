"""The Hydra config groups, shipped with the package (`pkg://omni.conf`): `train.yaml` and one
folder per group (model/, rollout/, algorithm/, reward/, data/, trainer/, logger/, ...), each
YAML typed by its schema in `omni.config`. Not code: this file only makes it a package."""
