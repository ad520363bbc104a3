package passthrough

import (
	"testing"
)

type tobj struct{ id uint64 }

func (o *tobj) tableID() uint64      { return o.id }
func (o *tobj) setTableID(id uint64) { o.id = id }

func TestSlotTableInsertAt(t *testing.T) {
	tests := []struct {
		name string
		ids  []uint64 // inserted with insertAt, in this order
		bad  []uint64 // refused by insertAt afterwards
	}{
		{name: "ascending", ids: []uint64{1<<32 | 2, 1<<32 | 66, 3<<32 | 130}},
		{name: "descending", ids: []uint64{3<<32 | 5000, 2<<32 | 4000, 7<<32 | 64, 1<<32 | 0}},
		{name: "generation zero", ids: []uint64{2, 3, 64, 65}},
		{name: "sparse", ids: []uint64{9<<32 | (maxSlots - 1), 1<<32 | 7}},
		{name: "refused", ids: []uint64{1<<32 | 3},
			bad: []uint64{0, 1<<32 | 3, 2<<32 | 3, maxSlots, 1<<32 | maxSlots}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var tab slotTable[tobj, *tobj]
			live := map[uint64]bool{}
			for _, id := range tc.ids {
				if !tab.insertAt(id, &tobj{}) {
					t.Fatalf("insertAt(%#x) refused", id)
				}
				live[id] = true
			}
			for _, id := range tc.bad {
				if tab.insertAt(id, &tobj{}) {
					t.Fatalf("insertAt(%#x) accepted", id)
				}
			}
			if tab.len() != len(tc.ids) {
				t.Fatalf("len %d, want %d", tab.len(), len(tc.ids))
			}
			for id := range live {
				if o := tab.get(id); o == nil || o.id != id {
					t.Fatalf("get(%#x) = %v", id, o)
				}
			}
			// New ids never collide with the restored ones, whatever
			// shard they come from, and every slot is used once.
			seen := map[uint32]bool{}
			for id := range live {
				seen[uint32(id)] = true
			}
			for i := range 3 * 64 * 70 {
				o := &tobj{}
				if !tab.insert(uint32(i), o) {
					t.Fatal("table full")
				}
				if live[o.id] || seen[uint32(o.id)] {
					t.Fatalf("insert gave %#x, already in use", o.id)
				}
				seen[uint32(o.id)] = true
				live[o.id] = true
			}
			n := 0
			tab.each(func(*tobj) { n++ })
			if n != len(live) {
				t.Fatalf("each saw %d, want %d", n, len(live))
			}
			// A freed restored slot comes back under a new id.
			for _, id := range tc.ids {
				if !tab.remove(id) {
					t.Fatalf("remove(%#x)", id)
				}
				delete(live, id)
				o := &tobj{}
				if !tab.insert(uint32(id), o) {
					t.Fatal("table full")
				}
				if o.id == id || live[o.id] {
					t.Fatalf("reused %#x as %#x", id, o.id)
				}
				live[o.id] = true
			}
			got := 0
			tab.drain(func(*tobj) { got++ })
			if got != len(live) || tab.len() != 0 {
				t.Fatalf("drain %d of %d, len %d", got, len(live), tab.len())
			}
		})
	}
}

// Restored ids that do not fit a slot (taken, out of range, or an index
// beyond the limit) live in the overflow map: found, listed, removed and
// drained like the others, and never handed out again by insert.
func TestSlotTableOverflow(t *testing.T) {
	var tab slotTable[tobj, *tobj]
	if tab.get(0) != nil || tab.remove(0) {
		t.Fatal("empty table has id 0")
	}
	const limit = 1 << 12
	restored := []struct {
		id   uint64
		over bool
	}{
		{3, false},                  // Rust's counter: generation 0
		{1<<32 | 3, true},           // the same index (ours → Rust → ours)
		{0, true},                   // the Rust daemon's first handle id
		{1<<32 | 4, false},          //
		{maxSlots, true},            // index out of range
		{5<<32 | (limit + 1), true}, // index beyond the limit
		{^uint64(0), true},          // the largest id
	}
	for _, r := range restored {
		if got := tab.restore(r.id, &tobj{}, limit); got != r.over {
			t.Fatalf("restore(%#x) overflowed %v, want %v", r.id, got, r.over)
		}
	}
	if tab.len() != len(restored) || tab.nover.Load() != 5 {
		t.Fatalf("len %d, overflow %d", tab.len(), tab.nover.Load())
	}
	for _, r := range restored {
		if o := tab.get(r.id); o == nil || o.id != r.id {
			t.Fatalf("get(%#x) = %v", r.id, o)
		}
	}
	// Index 3's next generations are 1 (in the overflow map), then 2.
	if !tab.remove(3) {
		t.Fatal("remove(3)")
	}
	o := &tobj{}
	if !tab.insert(3, o) {
		t.Fatal("table full")
	}
	if o.id != 2<<32|3 {
		t.Fatalf("insert into slot 3 gave %#x, want %#x", o.id, uint64(2<<32|3))
	}
	live := map[uint64]bool{o.id: true}
	for _, r := range restored[1:] {
		live[r.id] = true
	}
	for i := range 64 * 70 {
		o := &tobj{}
		if !tab.insert(uint32(i), o) {
			t.Fatal("table full")
		}
		if live[o.id] {
			t.Fatalf("insert gave %#x, in use", o.id)
		}
		live[o.id] = true
	}
	n := 0
	tab.each(func(*tobj) { n++ })
	if n != len(live) || tab.len() != len(live) {
		t.Fatalf("each saw %d, len %d, want %d", n, tab.len(), len(live))
	}
	if !tab.remove(0) || tab.get(0) != nil || tab.remove(0) {
		t.Fatal("remove of an overflow id")
	}
	delete(live, 0)
	got := 0
	tab.drain(func(*tobj) { got++ })
	if got != len(live) || tab.len() != 0 || tab.nover.Load() != 0 || tab.get(^uint64(0)) != nil {
		t.Fatalf("drain %d of %d, len %d", got, len(live), tab.len())
	}
}

// BenchmarkSlotTableGet: a lookup of an id held in a slot, with the
// overflow map empty (every session without a foreign migration) and not
// (the hit never consults it), and a miss with it empty.
func BenchmarkSlotTableGet(b *testing.B) {
	var tab slotTable[tobj, *tobj]
	ids := make([]uint64, 1024)
	for k := range ids {
		o := &tobj{}
		tab.insert(uint32(k), o)
		ids[k] = o.id
	}
	run := func(b *testing.B, ids []uint64) {
		b.ReportAllocs()
		for n := 0; b.Loop(); n++ {
			if tab.get(ids[n&1023]) == nil && ids[0] != 0 {
				b.Fatal("miss")
			}
		}
	}
	b.Run("hit", func(b *testing.B) { run(b, ids) })
	missing := make([]uint64, len(ids))
	for k, id := range ids {
		missing[k] = id + 1<<40
	}
	b.Run("miss", func(b *testing.B) {
		b.ReportAllocs()
		for n := 0; b.Loop(); n++ {
			if tab.get(missing[n&1023]) != nil {
				b.Fatal("hit")
			}
		}
	})
	tab.restore(1<<33|5, &tobj{}, maxSlots)
	b.Run("hit with overflow", func(b *testing.B) { run(b, ids) })
}
