package passthrough

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The migratable state as plain records, apart from any encoding
// (stateenc.go holds ours; the Rust virtiofsd's postcard format is to map
// onto the same records: its FullPath inodes are path strings, its
// OpenInode handles are flags).
//
// Ids are restored exactly: the guest kernel caches node ids and file
// handles. No "next id" counter travels: the destination's tables put
// every index below a restored one on their free lists (slotTable.insertAt)
// and give a reused slot a new generation, so a new id never equals one in
// use. The root (node id 1, the shared directory) is implicit: it has no
// record, and its lookup count is not kept (it is pinned).

// migState is what a destination needs to serve the guest's FUSE session.
type migState struct {
	Inodes  []inodeRecord
	Handles []handleRecord
}

// inodeRecord is one inode the guest holds.
type inodeRecord struct {
	ID      uint64 // node id
	Nlookup uint64 // the guest's lookup count, at least 1
	Type    uint32 // S_IFMT bits
	// Path leads from the shared directory to the object: relative, no
	// empty, "." or ".." component, never through a symlink. Empty when
	// Unreachable.
	Path string
	// Unreachable: the source found no path (unlinked on the host, an
	// O_TMPFILE, or a stale inode itself).
	Unreachable bool
}

// handleRecord is one open file or directory.
type handleRecord struct {
	ID    uint64 // file handle
	Inode uint64 // node id of its inode (rootID for the shared directory)
	// Flags are the host open flags without O_CREAT, O_EXCL, O_TRUNC and
	// O_CLOEXEC: what to reopen it with.
	Flags uint32
	Dir   bool // OPENDIR (else OPEN/CREATE)
}

// Bounds checked before anything is allocated for a state.
const (
	// maxStateInodes bounds the inode records: beyond what the guest can
	// hold as O_PATH fds under the largest RLIMIT_NOFILE (fs.nr_open is
	// 1M by default), with room for file handle mode.
	maxStateInodes = 1 << 22
	// maxStateHandles bounds the handle records: each is an open fd.
	maxStateHandles = 1 << 20
	// maxStatePath is PATH_MAX without the NUL.
	maxStatePath = 4095
)

// checkStatePath checks a path of a state: relative to the shared
// directory, at most maxStatePath bytes, components of 1..NAME_MAX bytes
// without NUL, none "." or "..".
func checkStatePath(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("empty path")
	case len(p) > maxStatePath:
		return fmt.Errorf("path of %d bytes (max %d)", len(p), maxStatePath)
	case p[0] == '/':
		return fmt.Errorf("absolute path")
	case strings.IndexByte(p, 0) >= 0:
		return fmt.Errorf("path with a NUL byte")
	}
	for c := range strings.SplitSeq(p, "/") {
		switch {
		case c == "":
			return fmt.Errorf("path with an empty component")
		case c == "." || c == "..":
			return fmt.Errorf("path with a %q component", c)
		case len(c) > nameMax:
			return fmt.Errorf("path component of %d bytes (max %d)", len(c), nameMax)
		}
	}
	return nil
}

func validType(t uint32) bool {
	switch t {
	case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		return true
	}
	return false
}

// validate checks a decoded state before anything is opened: ids, counts,
// references and paths. Paths are VMM input; so is everything else.
func (s *migState) validate() error {
	if len(s.Inodes) > maxStateInodes {
		return fmt.Errorf("%d inodes (max %d)", len(s.Inodes), maxStateInodes)
	}
	if len(s.Handles) > maxStateHandles {
		return fmt.Errorf("%d handles (max %d)", len(s.Handles), maxStateHandles)
	}
	types := make(map[uint64]uint32, len(s.Inodes)+1)
	types[rootID] = unix.S_IFDIR
	for k := range s.Inodes {
		r := &s.Inodes[k]
		switch {
		case r.ID == 0 || r.ID == rootID:
			return fmt.Errorf("inode %d: node id %d is reserved", k, r.ID)
		case uint32(r.ID) >= maxSlots:
			return fmt.Errorf("inode %d: node id %#x out of range", k, r.ID)
		case types[r.ID] != 0:
			return fmt.Errorf("inode %d: duplicate node id %#x", k, r.ID)
		case r.Nlookup == 0:
			return fmt.Errorf("node %#x: lookup count 0", r.ID)
		case !validType(r.Type):
			return fmt.Errorf("node %#x: bad file type %#o", r.ID, r.Type)
		case r.Unreachable && r.Path != "":
			return fmt.Errorf("node %#x: unreachable with a path", r.ID)
		}
		if !r.Unreachable {
			if err := checkStatePath(r.Path); err != nil {
				return fmt.Errorf("node %#x: %w", r.ID, err)
			}
		}
		types[r.ID] = r.Type
	}
	seen := make(map[uint64]bool, len(s.Handles))
	for k := range s.Handles {
		h := &s.Handles[k]
		t := types[h.Inode]
		switch {
		case h.ID == 0:
			return fmt.Errorf("handle %d: file handle 0 is reserved", k)
		case uint32(h.ID) >= maxSlots:
			return fmt.Errorf("handle %d: file handle %#x out of range", k, h.ID)
		case seen[h.ID]:
			return fmt.Errorf("handle %d: duplicate file handle %#x", k, h.ID)
		case t == 0:
			return fmt.Errorf("handle %#x: its inode %#x is missing", h.ID, h.Inode)
		case h.Dir && t != unix.S_IFDIR:
			return fmt.Errorf("handle %#x: directory handle on node %#x of type %#o", h.ID, h.Inode, t)
		case !h.Dir && t != unix.S_IFREG && t != unix.S_IFDIR:
			// Only regular files and directories are ever opened.
			return fmt.Errorf("handle %#x: file handle on node %#x of type %#o", h.ID, h.Inode, t)
		}
		seen[h.ID] = true
	}
	return nil
}
