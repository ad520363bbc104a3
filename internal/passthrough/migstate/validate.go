package migstate

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Plan is what Validate derives from a state for its loader: the order in
// which to open the inodes, and per record its parent and the guest's
// lookup count. Slices are indexed as State.Inodes.
type Plan struct {
	// Order lists the records to open, each LocPath record after its
	// parent; the root is not in it.
	Order []int32
	// Parent is a LocPath record's parent (an index, the root's record
	// included), -1 for every other location.
	Parent []int32
	// Lookups is each record's Refcount without its children's
	// references: the guest's lookup count. A record without lookups is
	// only a way to its children.
	Lookups []uint64
	// Index maps a node id to its record.
	Index map[uint64]int32
	// Root is the root's record, -1 in a state without inodes (the guest
	// never mounted).
	Root int32
}

// Validate checks a decoded state before anything is opened: ids, counts,
// references, refcounts, types and paths. Every byte of a state is VMM
// input; what Validate accepts a loader can open in Plan's order, each
// handle's inode being one the guest holds.
func (s *State) Validate() (*Plan, error) {
	if err := s.checkMounts(); err != nil {
		return nil, err
	}
	p := &Plan{
		Parent:  make([]int32, len(s.Inodes)),
		Lookups: make([]uint64, len(s.Inodes)),
		Index:   make(map[uint64]int32, len(s.Inodes)),
		Root:    -1,
	}
	if err := p.index(s); err != nil {
		return nil, err
	}
	if err := p.linkParents(s); err != nil {
		return nil, err
	}
	order, err := p.topo(s)
	if err != nil {
		return nil, err
	}
	p.Order = order
	if err := p.checkHandles(s); err != nil {
		return nil, err
	}
	return p, nil
}

// checkMounts checks the record counts and the mount paths.
func (s *State) checkMounts() error {
	if len(s.Inodes) > maxInodes {
		return fmt.Errorf("%d inodes (max %d)", len(s.Inodes), maxInodes)
	}
	if len(s.Handles) > maxHandles {
		return fmt.Errorf("%d handles (max %d)", len(s.Handles), maxHandles)
	}
	if !s.V2 && len(s.MountPaths) > 0 {
		return fmt.Errorf("mount paths in a V1 state")
	}
	mounts := make(map[uint64]bool, len(s.MountPaths))
	for _, m := range s.MountPaths {
		if mounts[m.MountID] {
			return fmt.Errorf("mount id %d given twice", m.MountID)
		}
		if err := checkMountPath(m.Path); err != nil {
			return fmt.Errorf("mount id %d: %w", m.MountID, err)
		}
		mounts[m.MountID] = true
	}
	return nil
}

// index checks each record's id and fields and indexes it by id.
func (p *Plan) index(s *State) error {
	for k := range s.Inodes {
		r := &s.Inodes[k]
		switch {
		case r.ID == 0:
			return fmt.Errorf("inode %d: node id 0 is reserved", k)
		case r.Loc >= numLocs:
			return fmt.Errorf("node %#x: location kind %d", r.ID, r.Loc)
		case (r.ID == RootID) != (r.Loc == LocRoot):
			return fmt.Errorf("node %#x: the root is node 1 with the root location, and only it", r.ID)
		}
		if _, dup := p.Index[r.ID]; dup {
			return fmt.Errorf("inode %d: duplicate node id %#x", k, r.ID)
		}
		p.Index[r.ID] = int32(k)
		if r.Loc == LocRoot {
			p.Root = int32(k)
		}
		if err := r.check(); err != nil {
			return fmt.Errorf("node %#x: %w", r.ID, err)
		}
	}
	if len(s.Inodes) > 0 && p.Root < 0 {
		// The Rust loader defers every path below the root until it
		// has it, and fails.
		return fmt.Errorf("inodes without the root")
	}
	return nil
}

// check checks what a record says of itself: its type, path and handles.
func (r *Inode) check() error {
	if r.Type != 0 && !validType(r.Type) {
		return fmt.Errorf("bad file type %#o", r.Type)
	}
	if r.Loc == LocRoot && r.Type != 0 && r.Type != unix.S_IFDIR {
		return fmt.Errorf("the root of type %#o", r.Type)
	}
	if r.RawPath != "" {
		if r.Loc != LocInvalid {
			return fmt.Errorf("a trailer path for a location the message gives")
		}
		if err := CheckPath(r.RawPath); err != nil {
			return err
		}
	}
	switch r.Loc {
	case LocPath, LocFullPath:
		if err := CheckPath(r.Path); err != nil {
			return err
		}
	case LocFileHandle:
		if err := r.Handle.check(); err != nil {
			return err
		}
	}
	if r.Verify != nil {
		if err := r.Verify.check(); err != nil {
			return fmt.Errorf("reference %w", err)
		}
	}
	return nil
}

// linkParents finds each LocPath record's parent (present, a directory if
// its type is known, not itself) and takes the child references off the
// parents' refcounts, leaving the guest's lookups.
func (p *Plan) linkParents(s *State) error {
	children := make([]uint64, len(s.Inodes))
	for k := range s.Inodes {
		r := &s.Inodes[k]
		p.Parent[k] = -1
		if r.Loc != LocPath {
			continue
		}
		pi, ok := p.Index[r.Parent]
		switch {
		case !ok:
			return fmt.Errorf("node %#x: its parent %#x is missing", r.ID, r.Parent)
		case pi == int32(k):
			return fmt.Errorf("node %#x: its own parent", r.ID)
		}
		if t := s.Inodes[pi].Type; t != 0 && t != unix.S_IFDIR {
			return fmt.Errorf("node %#x: its parent %#x is of type %#o", r.ID, r.Parent, t)
		}
		p.Parent[k] = pi
		children[pi]++
	}
	for k := range s.Inodes {
		r := &s.Inodes[k]
		own := uint64(0)
		if r.Loc == LocRoot {
			own = 1 // the Rust loader frees a root whose count reaches 0
		}
		if r.Refcount < children[k]+own {
			return fmt.Errorf("node %#x: refcount %d below its %d child references", r.ID, r.Refcount, children[k]+own)
		}
		p.Lookups[k] = r.Refcount - children[k]
	}
	return nil
}

// topo orders the inodes so that each Path record comes after its parent,
// refusing a cycle; iterative, so a deep chain costs no stack.
func (p *Plan) topo(s *State) ([]int32, error) {
	const (
		unseen = iota
		visiting
		done
	)
	state := make([]uint8, len(s.Inodes))
	order := make([]int32, 0, len(s.Inodes))
	var stack []int32
	for k := range s.Inodes {
		if state[k] != unseen || int32(k) == p.Root {
			continue
		}
		stack = append(stack[:0], int32(k))
		state[k] = visiting
		for len(stack) > 0 {
			top := stack[len(stack)-1]
			if pi := p.Parent[top]; pi >= 0 && pi != p.Root && state[pi] != done {
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

// checkHandles checks that ids are unique and that every handle is on an
// inode the guest holds, of a type a handle of its kind can have.
func (p *Plan) checkHandles(s *State) error {
	seen := make(map[uint64]bool, len(s.Handles))
	for k := range s.Handles {
		h := &s.Handles[k]
		if seen[h.ID] {
			return fmt.Errorf("handle %d: duplicate file handle %#x", k, h.ID)
		}
		seen[h.ID] = true
		// The Rust loader refuses a handle without its inode whatever
		// --migration-on-error says; so does this one.
		t := uint32(unix.S_IFDIR)
		if h.Inode != RootID {
			k, ok := p.Index[h.Inode]
			if !ok {
				return fmt.Errorf("handle %#x: its inode %#x is missing", h.ID, h.Inode)
			}
			if p.Lookups[k] == 0 {
				// Only a directory on a child's path: the guest,
				// which pins an open file's inode, never forgot it.
				return fmt.Errorf("handle %#x: its inode %#x has no lookup", h.ID, h.Inode)
			}
			t = s.Inodes[k].Type
		} else if p.Root < 0 {
			return fmt.Errorf("handle %#x on the root of a state without one", h.ID)
		}
		dir := h.IsDir()
		switch {
		case t == 0:
		case dir && t != unix.S_IFDIR:
			return fmt.Errorf("handle %#x: directory handle on node %#x of type %#o", h.ID, h.Inode, t)
		case !dir && t != unix.S_IFREG && t != unix.S_IFDIR:
			// Only regular files and directories are ever opened.
			return fmt.Errorf("handle %#x: file handle on node %#x of type %#o", h.ID, h.Inode, t)
		}
	}
	return nil
}
