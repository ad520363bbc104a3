package passthrough

import (
	"sync"
	"sync/atomic"
)

// slotTable maps the 64-bit ids handed to the guest (node ids, file handles)
// to objects. An id is generation<<32 | index: index picks a slot, the
// generation (bumped whenever a slot is reused) makes stale ids miss. Ids are
// never pointers, and every id the guest sends is checked against the slot's
// current object.
//
// Reads are lock-free: two atomic loads (chunk, slot) and a compare. Inserts
// and removals lock one of tableShards shards, chosen by the caller's hint
// (slot index % tableShards == shard), so no single mutex is shared by every
// operation.
//
// A migration restores ids this daemon did not issue (the Rust virtiofsd's
// counters, whose handle ids start at 0; or two ids with one index, after
// ours → Rust → ours). Those whose slot is taken or out of reach go to the
// overflow map instead. It is only ever filled by restore, so it is empty
// unless a migration brought such ids, and costs the lookup of an id held
// in a slot nothing: get consults it only after the slot missed, behind
// one predictable branch on nover. insert never hands out an id the map
// holds.
type slotTable[T any, P interface {
	*T
	tableID() uint64
	setTableID(uint64)
}] struct {
	chunks [maxChunks]atomic.Pointer[[chunkSize]slot[T]]
	shards [tableShards]tableShard
	grow   sync.Mutex // serialises chunk creation
	count  atomic.Int64
	hi     atomic.Uint32 // one past the highest chunk created

	nover atomic.Int64 // entries in over
	omu   sync.RWMutex // guards over
	over  map[uint64]P
}

const (
	tableShards = 64
	chunkBits   = 12
	chunkSize   = 1 << chunkBits
	maxSlots    = 1 << 24 // 16M live objects per table; far above RLIMIT_NOFILE
	maxChunks   = maxSlots / chunkSize
	maxLocal    = maxSlots / tableShards
)

type slot[T any] struct {
	p   atomic.Pointer[T]
	gen uint32 // guarded by the owning shard's mutex
}

type tableShard struct {
	mu   sync.Mutex
	free []uint32
	next uint32 // next never-used local index
	_    [40]byte
}

// get returns the object for id, or nil.
func (t *slotTable[T, P]) get(id uint64) P {
	if idx := uint32(id); idx < maxSlots {
		if ch := t.chunks[idx>>chunkBits].Load(); ch != nil {
			if p := P(ch[idx&(chunkSize-1)].p.Load()); p != nil && p.tableID() == id {
				return p
			}
		}
	}
	if t.nover.Load() == 0 {
		return nil
	}
	return t.overGet(id)
}

func (t *slotTable[T, P]) overGet(id uint64) P {
	t.omu.RLock()
	defer t.omu.RUnlock()
	return t.over[id]
}

// overHas reports whether the overflow map holds id; the caller holds no
// table lock but may hold a shard's.
func (t *slotTable[T, P]) overHas(id uint64) bool {
	return t.nover.Load() != 0 && t.overGet(id) != nil
}

func (t *slotTable[T, P]) slotFor(idx uint32) *slot[T] {
	c := idx >> chunkBits
	ch := t.chunks[c].Load()
	if ch == nil {
		t.grow.Lock()
		if ch = t.chunks[c].Load(); ch == nil {
			ch = new([chunkSize]slot[T])
			t.chunks[c].Store(ch)
			if c >= t.hi.Load() {
				t.hi.Store(c + 1)
			}
		}
		t.grow.Unlock()
	}
	return &ch[idx&(chunkSize-1)]
}

// insert stores obj under a fresh id, sets the id on obj before publishing
// it, and returns false when the table is full.
func (t *slotTable[T, P]) insert(hint uint32, obj P) bool {
	si := hint % tableShards
	s := &t.shards[si]
	s.mu.Lock()
	var idx uint32
	var sl *slot[T]
	for {
		if n := len(s.free); n > 0 {
			idx = s.free[n-1]
			s.free = s.free[:n-1]
		} else {
			if s.next >= maxLocal {
				s.mu.Unlock()
				return false
			}
			idx = s.next*tableShards + si
			s.next++
		}
		sl = t.slotFor(idx)
		// insertAt may have taken a slot that was on the free list:
		// its entry is dropped here rather than searched for there.
		if sl.p.Load() == nil {
			break
		}
	}
	// A restored id in the overflow map may share this index: skip
	// its generation.
	for {
		sl.gen++
		if sl.gen != 0 && !t.overHas(uint64(sl.gen)<<32|uint64(idx)) {
			break
		}
	}
	obj.setTableID(uint64(sl.gen)<<32 | uint64(idx))
	sl.p.Store((*T)(obj))
	s.mu.Unlock()
	t.count.Add(1)
	return true
}

// insertAt stores obj under exactly id (a migrated id the guest already
// holds) and returns false when id's index is out of range or its slot is
// taken. The slot's generation becomes id's, so the slot's next reuse
// hands out a different id. Every never-used index of the shard below id's
// goes on the free list, and an index already there stays (insert drops
// entries whose slot is taken), so the table never hands out an id in use
// and insertAt costs O(1) amortised whatever the order of the ids.
func (t *slotTable[T, P]) insertAt(id uint64, obj P) bool {
	idx := uint32(id)
	if id>>32 == 0 && idx == 0 || idx >= maxSlots {
		return false
	}
	si, local := idx%tableShards, idx/tableShards
	s := &t.shards[si]
	s.mu.Lock()
	sl := t.slotFor(idx)
	if sl.p.Load() != nil {
		s.mu.Unlock()
		return false
	}
	for ; s.next < local; s.next++ {
		s.free = append(s.free, s.next*tableShards+si)
	}
	if s.next == local {
		s.next++
	}
	sl.gen = uint32(id >> 32)
	obj.setTableID(id)
	sl.p.Store((*T)(obj))
	s.mu.Unlock()
	t.count.Add(1)
	return true
}

// restore stores obj under exactly id (a migrated id the guest holds, not
// yet in the table): in its slot when the slot is free and its index below
// limit, else in the overflow map. limit keeps the free lists insertAt
// grows in proportion to what is restored, not to the largest id a state
// names. It reports whether id went to the overflow map.
func (t *slotTable[T, P]) restore(id uint64, obj P, limit uint32) (overflowed bool) {
	if uint32(id) < limit && t.insertAt(id, obj) {
		return false
	}
	obj.setTableID(id)
	t.omu.Lock()
	if t.over == nil {
		t.over = make(map[uint64]P)
	}
	t.over[id] = obj
	t.nover.Store(int64(len(t.over)))
	t.omu.Unlock()
	t.count.Add(1)
	return true
}

// overRemove drops id from the overflow map and reports whether it was
// there.
func (t *slotTable[T, P]) overRemove(id uint64) bool {
	if t.nover.Load() == 0 {
		return false
	}
	t.omu.Lock()
	defer t.omu.Unlock()
	if _, ok := t.over[id]; !ok {
		return false
	}
	delete(t.over, id)
	t.nover.Store(int64(len(t.over)))
	t.count.Add(-1)
	return true
}

// each calls fn on every object in the table. It takes no lock: objects
// inserted or removed meanwhile may or may not be seen, and fn gets no
// reference (use tryRef).
func (t *slotTable[T, P]) each(fn func(P)) {
	for c := range t.chunks {
		ch := t.chunks[c].Load()
		if ch == nil {
			continue
		}
		for j := range ch {
			if p := P(ch[j].p.Load()); p != nil {
				fn(p)
			}
		}
	}
	if t.nover.Load() == 0 {
		return
	}
	t.omu.RLock()
	over := make([]P, 0, len(t.over))
	for _, p := range t.over {
		over = append(over, p)
	}
	t.omu.RUnlock()
	for _, p := range over {
		fn(p)
	}
}

// remove drops id from the table and reports whether it was present.
func (t *slotTable[T, P]) remove(id uint64) bool {
	idx := uint32(id)
	if idx >= maxSlots || t.chunks[idx>>chunkBits].Load() == nil {
		return t.overRemove(id)
	}
	s := &t.shards[idx%tableShards]
	s.mu.Lock()
	sl := t.slotFor(idx)
	p := P(sl.p.Load())
	if p == nil || p.tableID() != id {
		s.mu.Unlock()
		return t.overRemove(id)
	}
	sl.p.Store(nil)
	s.free = append(s.free, idx)
	s.mu.Unlock()
	t.count.Add(-1)
	return true
}

// drain removes every object and calls fn on each (outside the locks).
func (t *slotTable[T, P]) drain(fn func(P)) {
	var got []P
	for si := range t.shards {
		s := &t.shards[si]
		s.mu.Lock()
		for l := uint32(0); l < s.next; l++ {
			idx := l*tableShards + uint32(si)
			sl := t.slotFor(idx)
			if p := P(sl.p.Load()); p != nil {
				sl.p.Store(nil)
				s.free = append(s.free, idx)
				t.count.Add(-1)
				got = append(got, p)
			}
		}
		s.mu.Unlock()
	}
	if t.nover.Load() != 0 {
		t.omu.Lock()
		for id, p := range t.over {
			got = append(got, p)
			delete(t.over, id)
			t.count.Add(-1)
		}
		t.nover.Store(0)
		t.omu.Unlock()
	}
	for _, p := range got {
		fn(p)
	}
}

// span is one past the highest slot index a chunk exists for (a clock
// sweep's range).
func (t *slotTable[T, P]) span() uint32 { return t.hi.Load() * chunkSize }

// at returns the object in slot idx, or nil (no reference: use tryRef).
func (t *slotTable[T, P]) at(idx uint32) P {
	if ch := t.chunks[idx>>chunkBits].Load(); ch != nil {
		return P(ch[idx&(chunkSize-1)].p.Load())
	}
	return nil
}

// len returns the number of live objects.
func (t *slotTable[T, P]) len() int { return int(t.count.Load()) }
