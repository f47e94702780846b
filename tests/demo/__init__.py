"""The template's demo data set (GTSRB): its source, recipe and names, and the stages on its real sample. A project
generated without the demo has no such folder."""
