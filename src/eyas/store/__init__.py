"""The hidden-state store: its layout, shard files, writer and reader, the `eyas store` commands, importers from
other tools' layouts, and extraction, which fills a store from a target.
"""
