package passthrough

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The migratable state as plain records, apart from any encoding
// (stateenc.go reads and writes them). They are the Rust virtiofsd's
// serialized structs (src/passthrough/device_state/serialized.rs, 1.13),
// field for field, plus what our trailer adds (marked "ours"): a stream
// either daemon wrote decodes into them.
//
// Ids are restored exactly, whatever their value: the guest kernel caches
// node ids and file handles. The destination's tables hold an id in its
// slot when they can and in their overflow map otherwise (slotTable
// .restore), and never issue an id in use. NextInode and NextHandle are the
// Rust daemon's counters: written above every id in use, ignored on load.

// migState is what a destination needs to serve the guest's FUSE session.
type migState struct {
	// V2: the Rust PassthroughFs::V2 (with MountPaths); else V1.
	V2         bool
	Inodes     []inodeRecord
	NextInode  uint64
	Handles    []handleRecord
	NextHandle uint64
	Opts       negotiatedOpts
	MountPaths []mountPath // V2 only

	// Ours: the trailer was present (a stream of this daemon); Session
	// is the FUSE server's session record it carried (opaque here).
	Ours    bool
	Session []byte
}

// negotiatedOpts are the Rust NegotiatedOpts: what INIT turned on that the
// file system must keep doing.
type negotiatedOpts struct {
	Writeback         bool
	AnnounceSubmounts bool
	PosixACL          bool
	SuppGroups        bool // sup_group_extension: CREATE_SUPP_GROUP negotiated
}

// mountPath maps a mount id of the source (valid only there) to a path in
// the share on that mount, for file handles (V2's mount_paths).
type mountPath struct {
	MountID uint64
	Path    string // "." for the share's own mount
}

// locKind is the Rust InodeLocation variant (its index on the wire).
type locKind uint32

const (
	locRoot       locKind = iota // the shared directory itself (node 1)
	locPath                      // Parent's inode, then Path below it
	locInvalid                   // the source could not describe it
	locFullPath                  // Path below the shared directory
	locFileHandle                // Handle on the mount MountPaths names
	numLocKinds
)

// fileHandleRecord is the Rust SerializableFileHandle.
type fileHandleRecord struct {
	MountID uint64 // the source's mount id
	Type    int32  // handle_type
	Bytes   []byte // f_handle, at most maxHandleBytes
}

// inodeRecord is one inode (the Rust serialized::Inode).
type inodeRecord struct {
	ID uint64
	// Refcount is the guest's lookup count plus one per record whose
	// location is locPath with this inode as Parent (that reference is
	// dropped once the child is found). The root's also counts the
	// daemon's own two.
	Refcount uint64
	Loc      locKind
	Parent   uint64           // locPath
	Path     string           // locPath: below Parent; locFullPath: below the share
	Handle   fileHandleRecord // locFileHandle
	// Verify, when set, is the object's file handle on the source: the
	// destination compares the handle of what it opened
	// (--migration-verify-handles).
	Verify *fileHandleRecord

	// Ours: the S_IFMT type (0: unknown), and a path the message could
	// not carry (not UTF-8; the message says locInvalid).
	Type    uint32
	RawPath string
}

// handleRecord is one open file or directory (the Rust serialized::Handle
// with HandleSource::OpenInode).
type handleRecord struct {
	ID    uint64
	Inode uint64 // rootID for the shared directory
	// Flags are the open(2) flags as the Rust daemon records them: the
	// guest's, without O_APPEND (writes append by their own flag),
	// O_CREAT, O_EXCL and O_TRUNC, with O_DIRECTORY for OPENDIR.
	Flags int32

	// Ours: Known when the trailer described the handle; then Dir
	// (OPENDIR) and HostFlags (our host open flags without O_CREAT,
	// O_EXCL, O_TRUNC and O_CLOEXEC).
	Known     bool
	Dir       bool
	HostFlags uint32
}

// Bounds checked before anything is allocated for a state.
const (
	// maxStateInodes bounds the inode records: beyond what the guest can
	// hold as O_PATH fds under the largest RLIMIT_NOFILE (fs.nr_open is
	// 1M by default), with room for file handle mode.
	maxStateInodes = 1 << 22
	// maxStateHandles bounds the handle records: each is an open fd.
	maxStateHandles = 1 << 20
	// maxStateMounts bounds the mount paths.
	maxStateMounts = 1 << 16
	// maxStatePath is PATH_MAX without the NUL.
	maxStatePath = 4095
	// maxHandleBytes is MAX_HANDLE_SZ.
	maxHandleBytes = 128
	// maxSessionRecord bounds the FUSE server's session record.
	maxSessionRecord = 4096
)

// checkStatePath checks a path of a state: relative, at most maxStatePath
// bytes, components of 1..NAME_MAX bytes without NUL, none "." or "..".
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

// checkMountPath checks a mount path: "." (the share) or a state path.
func checkMountPath(p string) error {
	if p == "." {
		return nil
	}
	return checkStatePath(p)
}

func validType(t uint32) bool {
	switch t {
	case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		return true
	}
	return false
}

func (h *fileHandleRecord) check() error {
	if len(h.Bytes) == 0 || len(h.Bytes) > maxHandleBytes {
		return fmt.Errorf("file handle of %d bytes (1 to %d)", len(h.Bytes), maxHandleBytes)
	}
	return nil
}

// loadPlan is what validate derives from a state for stage: the order in
// which to open the inodes (every Path record after its parent), and per
// record its parent's index and the guest's lookup count.
type loadPlan struct {
	order   []int32  // indexes into Inodes, parents first; the root is not in it
	parent  []int32  // locPath: the parent's index, -1 for the root
	lookups []uint64 // Refcount minus the child references
	index   map[uint64]int32
	root    int32 // index of the root record, -1 without one
}

// validate checks a decoded state before anything is opened: ids, counts,
// references, refcounts and paths. Every byte of it is VMM input.
func (s *migState) validate() (*loadPlan, error) {
	if len(s.Inodes) > maxStateInodes {
		return nil, fmt.Errorf("%d inodes (max %d)", len(s.Inodes), maxStateInodes)
	}
	if len(s.Handles) > maxStateHandles {
		return nil, fmt.Errorf("%d handles (max %d)", len(s.Handles), maxStateHandles)
	}
	if !s.V2 && len(s.MountPaths) > 0 {
		return nil, fmt.Errorf("mount paths in a V1 state")
	}
	mounts := make(map[uint64]bool, len(s.MountPaths))
	for _, m := range s.MountPaths {
		if mounts[m.MountID] {
			return nil, fmt.Errorf("mount id %d given twice", m.MountID)
		}
		if err := checkMountPath(m.Path); err != nil {
			return nil, fmt.Errorf("mount id %d: %w", m.MountID, err)
		}
		mounts[m.MountID] = true
	}

	p := &loadPlan{
		parent:  make([]int32, len(s.Inodes)),
		lookups: make([]uint64, len(s.Inodes)),
		index:   make(map[uint64]int32, len(s.Inodes)),
		root:    -1,
	}
	for k := range s.Inodes {
		r := &s.Inodes[k]
		switch {
		case r.ID == 0:
			return nil, fmt.Errorf("inode %d: node id 0 is reserved", k)
		case r.Loc >= numLocKinds:
			return nil, fmt.Errorf("node %#x: location kind %d", r.ID, r.Loc)
		case (r.ID == rootID) != (r.Loc == locRoot):
			return nil, fmt.Errorf("node %#x: the root is node 1 with the root location, and only it", r.ID)
		}
		if _, dup := p.index[r.ID]; dup {
			return nil, fmt.Errorf("inode %d: duplicate node id %#x", k, r.ID)
		}
		p.index[r.ID] = int32(k)
		if r.Loc == locRoot {
			p.root = int32(k)
		}
		if r.Type != 0 && !validType(r.Type) {
			return nil, fmt.Errorf("node %#x: bad file type %#o", r.ID, r.Type)
		}
		if r.Loc == locRoot && r.Type != 0 && r.Type != unix.S_IFDIR {
			return nil, fmt.Errorf("node %#x: the root of type %#o", r.ID, r.Type)
		}
		if r.RawPath != "" {
			if r.Loc != locInvalid {
				return nil, fmt.Errorf("node %#x: a trailer path for a location the message gives", r.ID)
			}
			if err := checkStatePath(r.RawPath); err != nil {
				return nil, fmt.Errorf("node %#x: %w", r.ID, err)
			}
		}
		switch r.Loc {
		case locPath, locFullPath:
			if err := checkStatePath(r.Path); err != nil {
				return nil, fmt.Errorf("node %#x: %w", r.ID, err)
			}
		case locFileHandle:
			if err := r.Handle.check(); err != nil {
				return nil, fmt.Errorf("node %#x: %w", r.ID, err)
			}
		}
		if r.Verify != nil {
			if err := r.Verify.check(); err != nil {
				return nil, fmt.Errorf("node %#x: reference %w", r.ID, err)
			}
		}
	}
	if len(s.Inodes) > 0 && p.root < 0 {
		// The Rust loader defers every path below the root until it
		// has it, and fails.
		return nil, fmt.Errorf("inodes without the root")
	}

	// Parents: present, a directory if known, no cycle. The child
	// references come off the parents' refcounts.
	children := make([]uint64, len(s.Inodes))
	for k := range s.Inodes {
		r := &s.Inodes[k]
		p.parent[k] = -1
		if r.Loc != locPath {
			continue
		}
		pi, ok := p.index[r.Parent]
		switch {
		case !ok:
			return nil, fmt.Errorf("node %#x: its parent %#x is missing", r.ID, r.Parent)
		case pi == int32(k):
			return nil, fmt.Errorf("node %#x: its own parent", r.ID)
		}
		if t := s.Inodes[pi].Type; t != 0 && t != unix.S_IFDIR {
			return nil, fmt.Errorf("node %#x: its parent %#x is of type %#o", r.ID, r.Parent, t)
		}
		p.parent[k] = pi
		children[pi]++
	}
	for k := range s.Inodes {
		r := &s.Inodes[k]
		own := uint64(0)
		if r.Loc == locRoot {
			own = 1 // the Rust loader frees a root whose count reaches 0
		}
		if r.Refcount < children[k]+own {
			return nil, fmt.Errorf("node %#x: refcount %d below its %d child references", r.ID, r.Refcount, children[k]+own)
		}
		p.lookups[k] = r.Refcount - children[k]
	}
	order, err := p.topo(s)
	if err != nil {
		return nil, err
	}
	p.order = order

	seen := make(map[uint64]bool, len(s.Handles))
	for k := range s.Handles {
		h := &s.Handles[k]
		if seen[h.ID] {
			return nil, fmt.Errorf("handle %d: duplicate file handle %#x", k, h.ID)
		}
		seen[h.ID] = true
		// The Rust loader refuses a handle without its inode whatever
		// --migration-on-error says; so does this one.
		t := uint32(unix.S_IFDIR)
		if h.Inode != rootID {
			k, ok := p.index[h.Inode]
			if !ok {
				return nil, fmt.Errorf("handle %#x: its inode %#x is missing", h.ID, h.Inode)
			}
			if p.lookups[k] == 0 {
				// Only a directory on a child's path: the guest,
				// which pins an open file's inode, never forgot it.
				return nil, fmt.Errorf("handle %#x: its inode %#x has no lookup", h.ID, h.Inode)
			}
			t = s.Inodes[k].Type
		} else if p.root < 0 {
			return nil, fmt.Errorf("handle %#x on the root of a state without one", h.ID)
		}
		dir := h.isDir()
		switch {
		case t == 0:
		case dir && t != unix.S_IFDIR:
			return nil, fmt.Errorf("handle %#x: directory handle on node %#x of type %#o", h.ID, h.Inode, t)
		case !dir && t != unix.S_IFREG && t != unix.S_IFDIR:
			// Only regular files and directories are ever opened.
			return nil, fmt.Errorf("handle %#x: file handle on node %#x of type %#o", h.ID, h.Inode, t)
		}
	}
	return p, nil
}

// isDir tells a directory handle: from our trailer, else by the
// O_DIRECTORY the Rust daemon's OPENDIR adds.
func (h *handleRecord) isDir() bool {
	if h.Known {
		return h.Dir
	}
	return h.Flags&unix.O_DIRECTORY != 0
}

// topo orders the inodes so that each Path record comes after its parent,
// refusing a cycle; iterative, so a deep chain costs no stack.
func (p *loadPlan) topo(s *migState) ([]int32, error) {
	const (
		unseen = iota
		visiting
		done
	)
	state := make([]uint8, len(s.Inodes))
	order := make([]int32, 0, len(s.Inodes))
	var stack []int32
	for k := range s.Inodes {
		if state[k] != unseen || int32(k) == p.root {
			continue
		}
		stack = append(stack[:0], int32(k))
		state[k] = visiting
		for len(stack) > 0 {
			top := stack[len(stack)-1]
			if pi := p.parent[top]; pi >= 0 && pi != p.root && state[pi] != done {
				if state[pi] == visiting {
					return nil, fmt.Errorf("node %#x: a cycle of parents", s.Inodes[top].ID)
				}
				state[pi] = visiting
				stack = append(stack, pi)
				continue
			}
			stack = stack[:len(stack)-1]
			state[top] = done
			order = append(order, top)
		}
	}
	return order, nil
}
