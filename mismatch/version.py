"""The package's version: a leaf module, so the stages that stamp it into summary.json import no
package root (whose lazy names reach back up into the pipeline)."""

__version__ = "0.1.0"
