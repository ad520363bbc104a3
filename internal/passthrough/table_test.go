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
