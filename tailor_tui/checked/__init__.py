"""The one checked read path: every byte an output relies on is read through here.

- `files`: which file is read. A regular file only, never through a symbolic link that leaves its
  run (`confine`, `open_regular`), and the file the plan recorded: its identity (device, inode, size,
  mtime_ns, ctime_ns: `FileIdentity`) taken with fstat of the descriptor in the process that reads it,
  before and after the task reads (`PlannedFiles`, `read_as_planned`), compared with the identity the
  plan recorded when it opened the checkpoint. A file that changed is one line naming it, exit 4.
- `ranges`: how bytes are read. Exact reads, chunks through one reused buffer and their CRC-32s
  (`crc_range`, `RangeCrcs`), readahead for a sequential reader.
- `crc`: the CRC-32 arithmetic (combining, shifting, the CRC-32 of each block of a record).
- `evidence`: what the bytes read are checked against, where they are used. A record's stored CRC-32
  (`checked_crcs`, `read_and_check`), a partial save's slice CRC-32s (`SliceCheck`), the block CRC-32s
  the run's statistics recorded (`read_blocks`). Cached block CRC-32s are evidence of what the bytes
  should be, never proof of what they are now: only reading them proves that.

The writers of a composition and of an export, and the health statistics, read through it. The
verifier decodes with the formats' reference readers and shares only the file identities
(`planning.provenance`). It imports nothing of tailor_tui but the ground floor (`errors`, `events`).
"""

# its public API is its modules
__all__ = ["crc", "evidence", "files", "ranges"]
