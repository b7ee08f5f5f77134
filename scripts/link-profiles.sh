#!/usr/bin/env bash
# Make `snakemake --profile local|slurm` resolve: Snakemake searches ~/.config/snakemake (and
# /etc/xdg/snakemake) for a bare profile name, never the workflow's profiles/ folder.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${XDG_CONFIG_HOME:-$HOME/.config}/snakemake"
mkdir -p "$dest"
for p in local slurm; do
  ln -sfn "$PWD/profiles/$p" "$dest/$p"
  echo "linked $dest/$p -> $PWD/profiles/$p"
done
